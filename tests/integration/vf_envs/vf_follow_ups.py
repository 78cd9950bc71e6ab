"""A multi-turn verifiers environment in verifiers' own style: the environment asks follow-up questions.

The task's prompt opens; the environment (the caller of the agent's interaction, as a user) then asks up
to `follow_ups` more times, each answer a turn of its own. The reward is the share of turns answered, so
an episode that ends early (for instance when the context fills) still scores what it did.
"""

import verifiers.v1 as vf

FOLLOW_UPS = 3


class FollowUpTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def turns_answered(self, trace: vf.Trace) -> float:
        return trace.num_turns / (1 + FOLLOW_UPS)


class FollowUpConfig(vf.TasksetConfig):
    num_tasks: int = 4


class FollowUpTaskset(vf.Taskset[FollowUpTask, FollowUpConfig]):
    def load(self) -> list[FollowUpTask]:
        return [
            FollowUpTask(
                vf.TaskData(prompt=f"Count to {n}.", system_prompt="Answer briefly."), self.config.task
            )
            for n in range(2, 2 + self.config.num_tasks)
        ]


class FollowUpEnvConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()


class FollowUpEnv(vf.Env[FollowUpEnvConfig]):
    async def run(self, task, agents):
        async with agents.assistant.interaction(task) as chat:
            answer = await chat.turn()  # the task's prompt speaks first
            for i in range(FOLLOW_UPS):
                if answer.terminated:
                    break
                answer = await chat.turn(f"And once more, number {i + 2}?")


__all__ = ["FollowUpTaskset", "FollowUpEnv"]

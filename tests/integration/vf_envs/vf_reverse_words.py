"""A small verifiers environment written in verifiers' own style (as `vf init` lays one out): reverse a word."""

import random

import verifiers.v1 as vf

WORDS = ["tide", "wave", "shore", "coral", "reef", "kelp", "sand", "foam", "gull", "drift"]


class ReverseData(vf.TaskData):
    """One word and its reversal."""

    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks to build."""
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        rng = random.Random(self.config.seed)
        words = [rng.choice(WORDS) for _ in range(self.config.num_tasks)]
        return [
            ReverseTask(
                ReverseData(
                    prompt=word, system_prompt="Reverse the text character by character.", answer=word[::-1]
                ),
                self.config.task,
            )
            for word in words
        ]


__all__ = ["ReverseTaskset"]

"""Each environment's group strategy through `run_group`: single-turn groups are one request (a mix's
member too), others n independent rollouts with their own seed and session, each failing alone."""

import asyncio

from tests.unit.test_orchestrator_loop import FakeClient
from tidal.config.rl import SamplingConfig
from tidal.envs.base import Episode, SingleTurnEnv, Task
from tidal.envs.mix import EnvMix
from tidal.envs.multiturn import MultiTurnEnv
from tidal.inference.types import GenerateRequest, Generation
from tidal.models.tiny import build_tokenizer
from tidal.orchestrator.rollouts import REPLICAS_METRIC, run_group
from tidal.rollout.sampler import rollout_seed


class RecordingClient(FakeClient):
    """The fake client, recording each request's n, seed and session, and which sessions were ended."""

    def __init__(self) -> None:
        super().__init__(version=3)
        self.requests: list[tuple[int, int | None, str | None]] = []
        self.ended: list[str] = []

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        self.requests.append((request.n, request.sampling.seed, session_id))
        return await super().generate(request, session_id)

    def end_session(self, session_id: str) -> None:
        self.ended.append(session_id)


def reply_is_ab(task: Task, episode: Episode) -> float:
    return float(episode.messages[-1]["content"] == "ab")


class OneTurn(SingleTurnEnv):
    name = "one_turn"

    def default_rewards(self):  # type: ignore[no-untyped-def]
        return [(reply_is_ab, 1.0)]

    def num_tasks(self) -> int:
        return 10

    def task(self, index: int) -> Task:
        return Task(task_id=f"{self.name}/{index}", messages=[{"role": "user", "content": "hi"}])


class TwoTurns(MultiTurnEnv):
    """Answers the first turn once; the third rollout of a group raises in its rollout."""

    name = "two_turns"
    max_turns = 2

    def default_rewards(self):  # type: ignore[no-untyped-def]
        return [(reply_is_ab, 1.0)]

    def num_tasks(self) -> int:
        return 10

    def task(self, index: int) -> Task:
        return Task(task_id=f"{self.name}/{index}", messages=[{"role": "user", "content": "hi"}])

    async def env_response(self, task: Task, episode: Episode):  # type: ignore[no-untyped-def]
        return [{"role": "user", "content": "again"}]

    async def rollout(self, task, sampler):  # type: ignore[no-untyped-def]
        if sampler.session_id.endswith("#2"):
            raise KeyError("a broken episode")
        return await super().rollout(task, sampler)


def group(env, task, client, n=4):  # type: ignore[no-untyped-def]
    sampling = SamplingConfig(temperature=1.0, max_tokens=4)
    return asyncio.run(run_group(client, env, build_tokenizer(), task, 7, n, sampling, 11, 30.0))


def test_a_single_turn_group_is_one_request_even_inside_a_mix():
    mix = EnvMix([(OneTurn(), 1.0), (TwoTurns(), 1e-9)], seed=0)
    task = next(mix.task(i) for i in range(10) if mix.task(i).info["env"] == "one_turn")
    client = RecordingClient()
    result = group(mix, task, client)
    assert client.requests == [(4, rollout_seed(11, 7, 0), task.task_id)]
    assert result.env == "one_turn" and [r.reward for r in result.rollouts] == [1.0] * 4
    assert [r.rollout_id for r in result.rollouts] == [f"7/{i}" for i in range(4)]
    assert client.ended == [task.task_id]


def test_other_groups_are_independent_rollouts_each_failing_alone():
    env = TwoTurns()
    task = env.task(0)
    client = RecordingClient()
    result = group(env, task, client)
    # every rollout but the broken one sampled its two turns, turn t with its own seed + t, in its own session
    for index in (0, 1, 3):
        seed, session = rollout_seed(11, 7, index), f"{task.task_id}#{index}"
        assert {(1, seed, session), (1, seed + 1, session)} <= set(client.requests)
    assert len(client.requests) == 6
    rollouts = result.rollouts
    assert [r.failed for r in rollouts] == [False, False, True, False]
    assert rollouts[2].metrics["error/KeyError"] == 1.0
    assert all(
        r.metrics["num_turns"] == 2 and r.metrics[REPLICAS_METRIC] == 1.0 for r in rollouts if not r.failed
    )
    assert [r.policy_version for r in rollouts] == [3, 3, 0, 3]  # the broken one sampled nothing
    assert {f"{task.task_id}#{i}" for i in range(4)} <= set(client.ended)

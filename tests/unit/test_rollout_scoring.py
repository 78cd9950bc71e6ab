"""Which single-turn groups are scored inline (one episode after another, no task or timer each) and which
concurrently (awaiting rewards: async functions, reward workers, an environment's own `score`)."""

from tidal.envs.base import Episode, SingleTurnEnv, Task, rewards_run_by
from tidal.rollout.guard import scores_inline


class Env(SingleTurnEnv):
    def num_tasks(self) -> int:
        return 1

    def task(self, index: int) -> Task:
        return Task(task_id=str(index), messages=[{"role": "user", "content": "x"}])


def plain(task: Task, episode: Episode) -> float:
    return 1.0


async def judged(task: Task, episode: Episode) -> float:
    return 1.0


class OwnScore(Env):
    async def score(self, task: Task, episode: Episode) -> None:
        episode.reward = 0.0


class Runner:
    async def run(self, fn, task, episode):  # type: ignore[no-untyped-def]
        return fn(task, episode)


def test_only_plain_rewards_on_the_loop_are_scored_inline() -> None:
    assert scores_inline(Env(rewards=[(plain, 1.0)]))
    assert not scores_inline(Env(rewards=[(plain, 1.0), (judged, 0.5)]))  # an async judge overlaps
    assert not scores_inline(OwnScore(rewards=[(plain, 1.0)]))
    with rewards_run_by(Runner()):  # type: ignore[arg-type]  # reward workers: calls overlap across them
        assert not scores_inline(Env(rewards=[(plain, 1.0)]))

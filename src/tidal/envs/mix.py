"""EnvMix: several environments behind one `Environment`, each task drawn from one of them by weight.

Pure and deterministic: position p picks its environment with an RNG seeded by (seed, p), so a resumed or
repeated run sees the same sequence whatever order positions are asked in. Each task records its
environment in `Task.info["env"]` (report metrics per environment from it) and `rollout`, `rollout_group`
and `score` go to that environment (`env_of`), so a mixed single-turn environment keeps its one request
per group.
"""

import random
from dataclasses import replace

from tidal.envs.base import Environment, Episode, EpisodeWork, GroupSampler, Sampler, Task


class EnvMix(Environment):
    """`envs`: (environment, weight) pairs; names must be distinct, weights positive."""

    name = "mix"

    def __init__(self, envs: list[tuple[Environment, float]], seed: int = 0):
        if not envs:
            raise ValueError("EnvMix needs at least one environment")
        names = [env.name for env, _ in envs]
        if len(set(names)) != len(names):
            raise ValueError(f"EnvMix: environment names must be distinct, got {names}")
        if any(weight <= 0 for _, weight in envs):
            raise ValueError("EnvMix: every weight must be positive")
        super().__init__(rewards=[])
        self.envs = {env.name: env for env, _ in envs}
        self.names = names
        self.weights = [float(weight) for _, weight in envs]
        self.seed = seed

    def num_tasks(self) -> int:
        return sum(env.num_tasks() for env in self.envs.values())

    def env_at(self, position: int) -> Environment:
        rng = random.Random(f"mix/{self.seed}/{position}")
        return self.envs[rng.choices(self.names, weights=self.weights)[0]]

    def task(self, index: int) -> Task:
        env = self.env_at(index)
        task = env.task(index % env.num_tasks())
        return replace(task, info={**task.info, "env": env.name})

    def env_of(self, task: Task) -> Environment:
        name = task.info.get("env")
        if name not in self.envs:
            raise KeyError(f"task {task.task_id} names no environment of this mix (info['env'] = {name!r})")
        return self.envs[name]

    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        return await self.env_of(task).rollout(task, sampler)

    async def rollout_group(self, task: Task, sampler: GroupSampler, n: int) -> list[Episode | EpisodeWork]:
        return await self.env_of(task).rollout_group(task, sampler, n)

    async def score(self, task: Task, episode: Episode) -> None:
        await self.env_of(task).score(task, episode)

    async def aclose(self) -> None:
        """Release what members hold (a verifiers environment serves an interception endpoint)."""
        for env in self.envs.values():
            close = getattr(env, "aclose", None)
            if close is not None:
                await close()


def env_name(env: Environment, task: Task) -> str:
    """The environment a task belongs to: its mix member if it came from an `EnvMix`."""
    return str(task.info.get("env", env.name))

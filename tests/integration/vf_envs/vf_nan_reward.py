"""A verifiers environment whose reward is NaN: tidal must fail the rollout, naming env and reward."""

import verifiers.v1 as vf


class NanTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def not_a_number(self, trace: vf.Trace) -> float:
        return float("nan")


class NanTaskset(vf.Taskset[NanTask, vf.TasksetConfig]):
    def load(self) -> list[NanTask]:
        return [NanTask(vf.TaskData(prompt="hello"), self.config.task) for _ in range(2)]


__all__ = ["NanTaskset"]

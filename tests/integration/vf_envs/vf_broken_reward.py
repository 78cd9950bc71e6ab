"""A verifiers environment whose reward raises: tidal must count the rollout as failed and go on."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("reward bug")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> list[BrokenTask]:
        return [BrokenTask(vf.TaskData(prompt="hello"), self.config.task) for _ in range(2)]


__all__ = ["BrokenTaskset"]

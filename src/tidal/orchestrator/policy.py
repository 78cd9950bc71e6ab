"""Keep inference on the newest weights the trainer published, and let the rollout loop wait for a version."""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tidal.inference.client import InferenceClient
from tidal.inference.errors import NoHealthyServer
from tidal.inference.types import ServerVersion, WeightUpdateReport
from tidal.transport.nccl import is_announcement
from tidal.transport.weights import adapter_name, is_adapter_dir, latest_published

logger = logging.getLogger(__name__)


class PolicyWatcher:
    """Polls `<output_dir>/weights/` and fans each new step out to every server: full weights are loaded in
    place (pause, load, resume), a LoRA adapter is hot-loaded and becomes the model requests use.

    An NCCL step (`nccl.json`, tidal.transport.nccl) goes the same way, pause, receive, resume, while the
    trainer broadcasts it: the trainer waits until every server took part, so a server out of rotation
    would hang both sides, and the watcher stops the run instead.

    A server out of rotation (down, or being restarted) is left out of a full-weight or adapter update and
    loads it when it comes back (the client's health watch); the run waits for one to return when none is
    in rotation, up to the client's `recovery_timeout`.

    Consumes: published weight directories. Produces: `version`, the policy every server in rotation serves.
    """

    def __init__(self, client: InferenceClient, output_dir: Path, poll_interval: float = 0.05):
        self.client = client
        self.output_dir = Path(output_dir)
        self.poll_interval = poll_interval
        self.version = 0
        self.update_seconds = 0.0
        self.num_updates = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds per update phase inside the servers, summed (`WeightFanOut.phase_seconds`)."""
        return dict(self.client.weights.phase_seconds)

    async def start(self) -> None:
        await self.check_once()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def wait_for(self, version: int) -> float:
        """Block until inference serves at least `version`; returns the seconds waited.

        Raises the watcher's error if an update failed: waiting would otherwise never end."""
        start = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= version or self._failure is not None)
        if self._failure is not None:
            raise self._failure
        return time.perf_counter() - start

    async def newer_than(self, version: int) -> None:
        """Return once inference serves a version newer than `version`; raises the watcher's error."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version > version or self._failure is not None)
        if self._failure is not None:
            raise self._failure

    async def check_once(self) -> None:
        latest = latest_published(self.output_dir)
        if latest is None or latest[0] <= self.version:
            return
        step, path = latest
        start = time.perf_counter()
        what = f"weights of step {step}"
        if is_announcement(path):
            what = f"weights of step {step} (NCCL broadcast)"
            check_all_receive(self.client, step)
            report = await self.client.weights.load_step(path, step)
            if not report.all_ok:  # a broadcast that missed a receiver: no server may catch up alone
                raise RuntimeError(f"weight update to step {step} failed on {_failed(report)}")
        else:
            if is_adapter_dir(path):
                what = f"LoRA adapter {adapter_name(step)} (step {step})"
            await self._update(step, path)
        self.update_seconds += time.perf_counter() - start
        self.num_updates += 1
        async with self._changed:
            self.version = step
            self._changed.notify_all()
        logger.info("inference now serves %s", what)

    async def _update(self, step: int, path: Path) -> None:
        """Load `path` as `step` on every server in rotation. One that is out of rotation, or died during
        the update, loads it when it comes back (the client's health watch); with none in rotation, wait
        up to the client's `recovery_timeout` for one to return. A server in rotation that failed the
        update is asked once more (it may have been out of rotation and back since); failing again, it
        stops the run."""
        deadline = time.monotonic() + self.client.pool.recovery_timeout
        failures: Counter[str] = Counter()
        while True:
            report = await self._fan_out(step, path)
            if report.all_ok:
                return
            await self.client.pool.check_health()  # a server that died during the update leaves rotation now
            # failed, in rotation now and not caught up to this step on its return: ask it (again)
            in_rotation = [s for s in report.servers if not s.ok and self._behind(s.url, step)]
            failures.update(s.url for s in in_rotation)
            refused = [s for s in in_rotation if failures[s.url] > 1]
            if refused:
                raise RuntimeError(f"weight update to step {step} failed on {_failed(report, refused)}")
            if in_rotation:
                continue
            serving = [s for s in self.client.pool.servers.values() if s.healthy and s.version == step]
            if serving or any(s.ok for s in report.servers):
                return  # this step is served; the others load it when they come back
            if not any(s.healthy for s in self.client.pool.servers.values()):
                # once more with none to ask: a returning server then loads this step, not the one before
                # (which may be pruned from disk by the time it is back)
                await self._fan_out(step, path)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"weight update to step {step} failed on {_failed(report)}; no server is in rotation"
                )
            logger.warning("weights of step %d wait for an inference server to come back", step)
            try:
                await self.client.pool.wait_healthy(left, count=1)
            except NoHealthyServer as exc:
                raise RuntimeError(f"weight update to step {step}: {exc}") from None

    async def _fan_out(self, step: int, path: Path) -> WeightUpdateReport:
        if is_adapter_dir(path):
            return await self.client.weights.load_adapter_step(adapter_name(step), path, step)
        return await self.client.weights.load_step(path, step)

    def _behind(self, url: str, step: int) -> bool:
        server = self.client.pool.servers[url]
        return server.healthy and server.version != step

    async def _loop(self) -> None:
        try:
            while True:
                await self.check_once()
                await asyncio.sleep(self.poll_interval)
        except Exception as exc:  # handed to the step loop through wait_for
            async with self._changed:
                self._failure = exc
                self._changed.notify_all()


def _failed(report: WeightUpdateReport, servers: Sequence[ServerVersion] | None = None) -> str:
    failed = servers if servers is not None else [s for s in report.servers if not s.ok]
    return "; ".join(f"{s.url}: {s.error}" for s in failed)


def check_all_receive(client: InferenceClient, step: int) -> None:
    """An NCCL step reaches only servers that receive it together: refuse before any of them starts."""
    down = [s.url for s in client.pool.servers.values() if not s.healthy]
    if down:
        raise RuntimeError(
            f"NCCL weight update to step {step} needs every inference server, but {', '.join(down)} "
            "is out of rotation (a broadcast cannot skip a receiver): restart the run with --resume"
        )

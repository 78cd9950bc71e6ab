"""Restarting what dies: the decision (restart or stop, from a role's failures so far) and the record of
every failure and recovery (written to `<output_dir>/events.jsonl` by tidal.monitor.events). Pure.

A role is one inference replica (`inference`, `inference_<i>`), the trainer or the orchestrator; each has
its own count. What a restart does for each role (same port, resume from which state) is the launcher's.
"""

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.config.rl import CudaIpcPublish, NcclPublish, RLConfig, ZMQTransport


def max_restarts(config: RLConfig) -> int:
    """`restarts.max_restarts` as it applies: 0 where weights go by NCCL broadcast or a shared GPU buffer
    (RLConfig refuses a number set there; the default then means none)."""
    if isinstance(config.trainer.publish, NcclPublish | CudaIpcPublish):
        return 0
    return config.restarts.max_restarts


def keeps_batches(config: RLConfig) -> bool:
    """Whether sent batches outlive the orchestrator and stay until the trainer checkpointed past them
    (filesystem transport), so that the trainer and the orchestrator can each be restarted alone; with zmq
    they live in the orchestrator's memory and are handed out once, so both restart together."""
    return not isinstance(config.transport, ZMQTransport)


def recent(failures: Sequence[float], now: float, window: float) -> list[float]:
    """The failure times (monotonic) within `window` seconds before `now`."""
    return [t for t in failures if now - t <= window]


@dataclass
class RestartPolicy:
    """Restart a role unless it already had `limit` restarts within `window` seconds of this failure."""

    limit: int
    window: float
    failures: dict[str, list[float]] = field(default_factory=dict)
    """Each role's failure times (monotonic) that were restarted, within the window."""

    def allow(self, role: str, now: float) -> bool:
        """Record a failure of `role` at `now`; True if it may restart (then counted as one restart)."""
        past = recent(self.failures.get(role, []), now, self.window)
        if len(past) >= self.limit:
            return False
        self.failures[role] = [*past, now]
        return True

    def count(self, role: str) -> int:
        """Restarts of `role` within the window, this one included."""
        return len(self.failures.get(role, []))

    def refusal(self, role: str) -> str:
        """Why `role` is not restarted again (for the run's one-line error)."""
        if self.limit == 0:
            return "restarts are off (restarts.max_restarts = 0)"
        return (
            f"it was restarted {self.limit} time(s) within {self.window:.0f} s already "
            f"(restarts.max_restarts = {self.limit}, restarts.window)"
        )


def how_it_ended(code: int | None) -> dict[str, Any]:
    """`{"exit_code": 1}` or `{"signal": "SIGKILL"}` from a Popen return code (negative: a signal)."""
    if code is None:
        return {}
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": str(-code)}
    return {"exit_code": code}


@dataclass
class Recovery:
    """One failure being recovered from: when it happened (monotonic), and when the role was back and the
    trainer trained its next step since (None until then)."""

    role: str
    failed_at: float
    back_at: float | None = None
    next_step_at: float | None = None
    next_step: int | None = None

    def record(self) -> dict[str, Any]:
        """The recovery's fields for events.jsonl: seconds from the failure to the role back up, and to the
        trainer's next trained step (the run's own measure of what the failure cost)."""
        fields: dict[str, Any] = {"role": self.role}
        if self.back_at is not None:
            fields["seconds_lost"] = round(self.back_at - self.failed_at, 3)
        if self.next_step_at is not None:
            fields["seconds_to_next_step"] = round(self.next_step_at - self.failed_at, 3)
            fields["next_step"] = self.next_step
        return fields


def missing_batches(checkpoint_step: int, produced: int, on_disk: Sequence[int]) -> list[int]:
    """The batches a trainer resumed at `checkpoint_step` needs that are gone, of those the orchestrator
    certainly sent (all before its newest state `produced`, whose batch may be on its way: not counted)."""
    present = set(on_disk)
    return [step for step in range(checkpoint_step, produced - 1) if step not in present]

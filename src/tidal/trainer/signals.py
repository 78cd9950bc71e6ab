"""Graceful stop: SIGTERM/SIGINT set a flag the training loop checks between steps (then checkpoints)."""

import signal
import types


class StopSignal:
    """Records the first SIGTERM/SIGINT instead of dying mid-step; a second SIGINT (Ctrl-C twice) kills as
    usual. A repeated SIGTERM is the same request again: under Slurm every process of the job gets one, and
    torchrun and the launcher each forward theirs too; whoever cannot wait sends SIGKILL."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        if self.received is None:
            self.received = signum

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or 0)

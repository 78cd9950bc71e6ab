"""A supervised child process: own process group, output to a log file, dies with its parent, stops fully."""

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor is SIGKILLed, the child gets SIGTERM (Linux)."""
    with contextlib.suppress(
        OSError, AttributeError
    ):  # not Linux: no parent-death signal; stop() still cleans up
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_group_gone(pgid: int, grace: float) -> None:
    """Grandchildren (engine workers, torchrun ranks) may outlive the leader by a moment; none may stay."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)


def stop_group(process: "subprocess.Popen[bytes]", grace: float) -> int:
    """SIGTERM the process group led by `process`, SIGKILL after `grace` s, wait until none of it is left."""
    pgid = process.pid  # a session leader's pid is its group id
    if process.poll() is None:
        signal_group(pgid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
            process.wait()
    wait_group_gone(pgid, grace)
    return process.returncode


class ManagedProcess:
    """One named child in its own session, its stdout+stderr appended to `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open as long as the child runs
        self.process = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the whole group, SIGKILL after `grace` s, and wait until no process of the group is left."""
        if self.process is None:
            return None
        code = stop_group(self.process, grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

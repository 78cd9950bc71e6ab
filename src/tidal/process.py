"""A supervised child process: own process group, output to a log file, dies with its parent, stops fully.

`ManagedProcess` is the one wrapper every supervisor uses (`tidal rl`'s launcher, the per-node agent,
`tidal inference` around vLLM), and `wait_healthy` the one synchronous health wait.
"""

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


def die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor is SIGKILLed, the child gets SIGTERM (Linux)."""
    with contextlib.suppress(
        OSError, AttributeError
    ):  # not Linux: no parent-death signal; stop() still cleans up
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def exit_with_parent(parent_pid: int) -> None:
    """Runs first in a worker started without exec (multiprocessing, a helper process): SIGKILL it when the
    process (thread) that started it goes, even if that one was SIGKILLed; exit now if it already went."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the closed pipe or socket still ends it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


STOP_GRACE = 15.0
"""Seconds the launcher gives each child to stop before SIGKILL."""
INNER_STOP_GRACE = 10.0
"""Seconds a child gives its own process group (`tidal inference`: vLLM's server and engine) to stop:
shorter than STOP_GRACE, so that the child has stopped them itself before the launcher's SIGKILL."""
KILL_WAIT = 2.0
"""Seconds to wait for SIGKILLed processes to disappear."""


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass(frozen=True)
class ProcInfo:
    """One line of the process table: parent, process group, state (`Z`: a zombie, ended but not reaped)."""

    ppid: int
    pgid: int
    state: str


def process_table() -> dict[int, ProcInfo]:
    """Every process of this host from /proc (empty where there is no /proc)."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as fh:
                    stat = fh.read().decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
            table[int(entry.name)] = ProcInfo(ppid=int(fields[1]), pgid=int(fields[2]), state=fields[0])
    return table


def descendants(pid: int, table: dict[int, ProcInfo]) -> list[int]:
    """The processes below `pid` in `table`, children first (pure)."""
    children: dict[int, list[int]] = {}
    for child, info in table.items():
        children.setdefault(info.ppid, []).append(child)
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies count as ended: only their parent can reap
    them, and an orphan's new parent may be a container's pid 1 that never does)."""
    table = process_table()
    if table:
        return any(info.pgid == pgid and info.state not in "ZX" for info in table.values())
    try:  # no /proc: the kernel's answer, zombies included
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def wait_groups_gone(pgids: Collection[int], deadline: float) -> bool:
    """Wait until no process of `pgids` runs, or `deadline` (monotonic) passes; returns whether they are gone."""
    while any(group_alive(pgid) for pgid in pgids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def terminate_groups(pgids: Collection[int]) -> None:
    """SIGTERM every process of `pgids` at once, whether or not a group's leader still runs (vLLM's engine
    and workers outlive a killed API server); `finish_groups` then waits and SIGKILLs what is left."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)


def finish_groups(process: "subprocess.Popen[bytes]", pgids: Collection[int], deadline: float) -> int:
    """After `terminate_groups`: wait for `process` and its groups until `deadline` (monotonic), SIGKILL what
    is left then; `process` is reaped and its exit code returned."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    if not wait_groups_gone(pgids, deadline):
        for pgid in pgids:
            signal_group(pgid, signal.SIGKILL)
        wait_groups_gone(pgids, time.monotonic() + KILL_WAIT)
    return process.wait()


class DeathWatch:
    """When each watched process ended (time.monotonic()), for children and grandchildren alike: a pidfd
    (Linux >= 5.3) wakes `wait` the moment its process ends; without pidfds each `wait` reads /proc."""

    def __init__(self) -> None:
        self._watched: dict[int, int | None] = {}  # pid -> pidfd
        self.ended: dict[int, float] = {}

    def watch(self, pid: int) -> None:
        try:
            self._watched[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            self.ended[pid] = time.monotonic()
        except (AttributeError, OSError):
            self._watched[pid] = None

    def wait(self, timeout: float) -> None:
        """Sleep up to `timeout` s, less if a watched process ends; record the ones that ended."""
        fds = {fd: pid for pid, fd in self._watched.items() if fd is not None}
        if fds:
            ready, _, _ = select.select(list(fds), [], [], timeout)
        else:
            ready = []
            time.sleep(timeout)
        now = time.monotonic()
        for fd in ready:
            self._ended(fds[fd], now)
        table = process_table()
        for pid in [pid for pid, fd in self._watched.items() if fd is None]:
            if pid not in table or table[pid].state in "ZX":
                self._ended(pid, now)

    def _ended(self, pid: int, when: float) -> None:
        self.ended.setdefault(pid, when)
        fd = self._watched.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._watched.values():
            if fd is not None:
                os.close(fd)
        self._watched.clear()


class ManagedProcess:
    """One named child in its own session, its stdout+stderr appended to `log_path` (None: this process's
    own stdout and stderr)."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path | None, env: dict[str, str] | None = None
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.groups: list[int] = []
        """Process groups stopped with this child: its own (recorded at start), then any it started."""
        self._log: IO[bytes] | None = None
        self.stop_seconds: float | None = None
        """How long its stop took, from the SIGTERM until none of its groups was left (None: not stopped)."""

    def start(self) -> "ManagedProcess":
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - open as long as the child runs
        self.process = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.groups = [os.getpgid(self.process.pid)]  # its own session: the group id is its pid
        return self

    def adopt_descendants(self) -> list[int]:
        """Record the process groups of everything this child started (a server in its own session) so that
        `stop` signals them directly, even after this child died; returns the child's own children."""
        if self.process is None:
            return []
        table = process_table()
        for pid in descendants(self.process.pid, table):
            if table[pid].pgid not in self.groups:
                self.groups.append(table[pid].pgid)
        return [pid for pid, info in table.items() if info.ppid == self.process.pid]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ended_how(self) -> str:
        """`exited with code 1` / `was killed by signal 9` (after it ended)."""
        code = self.poll()
        return (
            f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        )

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM its groups at once, SIGKILL after `grace` s, and wait until no process of them is left."""
        stop_together([self], grace)
        return self.poll()

    def _finish(self, deadline: float, started: float) -> None:
        assert self.process is not None
        finish_groups(self.process, self.groups, deadline)
        self.stop_seconds = time.monotonic() - started
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, num_lines: int = 20) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def stop_together(children: Sequence[ManagedProcess], grace: float = STOP_GRACE) -> None:
    """Stop `children` side by side: SIGTERM all their groups at once, then wait for each until one shared
    deadline `grace` s away (SIGKILL after it), so that stopping several takes the slowest one's time, not
    the sum. Each child's `stop_seconds` says how long it took."""
    started = time.monotonic()
    running = [c for c in children if c.process is not None and c.stop_seconds is None]
    for child in running:
        terminate_groups(child.groups)
    for child in running:
        child._finish(started + grace, started)


def wait_healthy(
    targets: Mapping[str, ManagedProcess | None],
    timeout: float,
    should_stop: Callable[[], bool] = lambda: False,
    poll: float = 0.5,
    on_poll: Callable[[dict[str, ManagedProcess | None]], None] | None = None,
) -> dict[str, ManagedProcess | None]:
    """Poll `<url>/health` of every target until each answered 200 once; returns the ones that did not
    (empty: all healthy) when `timeout` s pass or `should_stop()` says so. A target's process that ends
    meanwhile raises `ProcessEnded` at once: waiting for it would only run out the clock. A target
    without a process (None) runs elsewhere (another node of a cluster run): only its URL is polled.
    `on_poll` is called after each round with the targets still waited for."""
    import httpx

    waiting = dict(targets)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline and not should_stop():
        for url, child in list(waiting.items()):
            if child is not None and not child.alive():
                raise ProcessEnded(child)
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    del waiting[url]
            except httpx.HTTPError:
                pass
        if waiting:
            if on_poll is not None:
                on_poll(waiting)
            time.sleep(poll)
    return waiting


class ProcessEnded(Exception):
    """A supervised child ended while it was waited for."""

    def __init__(self, child: ManagedProcess):
        super().__init__(f"{child.name} {child.ended_how()}")
        self.child = child

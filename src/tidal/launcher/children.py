"""The processes one node of a `tidal rl` run owns: started each in its own process group with its output in
`<output_dir>/logs/<name><suffix>.log`, started again with the command they first had, retired when they
failed, and stopped together at the end. The vLLM server under each `tidal inference` child is watched too:
it runs in a session of its own, so its death is not its parent's exit.

Which process to blame when several ended is decided here (`first_failure`); what to do about it is
tidal.launcher.restarter's.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tidal.process import DeathWatch, ManagedProcess, stop_together


@dataclass(order=True, frozen=True)
class Failure:
    """A child (or the vLLM server under a replica, `pid`) that ended, ordered by when (monotonic)."""

    when: float
    order: int
    child: ManagedProcess = field(compare=False)
    cause: str = field(compare=False)
    """`trainer was killed by signal 9`, `inference_1: its vLLM server (pid 123) died`."""
    code: int | None = field(compare=False)
    """The child's return code (negative: a signal); None for a server (not our child) or no exit."""
    pid: int | None = field(default=None, compare=False)
    """The server's pid when it is the server that died."""


class Children:
    """This node's children by role, the vLLM servers under the replicas, and the command each child first
    started with. `say` prints one line of the launcher's (how long stopping took)."""

    def __init__(self, logs: Path, suffix: str, say: Callable[[str], None]):
        self.logs = logs
        self.suffix = suffix
        self._say = say
        self.processes: list[ManagedProcess] = []
        """Every child started and not retired, in start order (the order failures at one instant are
        blamed in)."""
        self.replicas: list[ManagedProcess] = []
        """The `tidal inference` children, one per replica (also in `processes`)."""
        self.trainer: ManagedProcess | None = None
        self.orchestrator: ManagedProcess | None = None
        self.servers: dict[int, ManagedProcess] = {}
        """The vLLM servers' pids, each with the `tidal inference` child that started it."""
        self.deaths = DeathWatch()
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        """Each child's first command and environment by name: what a restart starts again."""

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        self.commands.setdefault(name, (argv, env))
        child = ManagedProcess(name, argv, self.logs / f"{name}{self.suffix}.log", env).start()
        self.processes.append(child)
        if child.pid is not None:
            self.deaths.watch(child.pid)
        return child

    def restart(self, name: str, *extra: str) -> ManagedProcess:
        """The child `name` again, with its first command (and `extra` arguments) and environment."""
        argv, env = self.commands[name]
        return self.start(name, [*argv, *extra], env)

    def retire(self, child: ManagedProcess) -> bool:
        """Stop a child that failed (or must restart with one that did), all its groups, and forget it;
        False if it was retired already."""
        if child not in self.processes:
            return False
        child.adopt_descendants()  # torchrun's workers, a vLLM server: their own sessions
        child.stop()
        self.processes.remove(child)
        if child in self.replicas:
            self.replicas.remove(child)
        for pid in [pid for pid, replica in self.servers.items() if replica is child]:
            del self.servers[pid]
        return True

    def watch_servers(self, replica: ManagedProcess) -> None:
        """Each vLLM server runs in its own session under `tidal inference`: watch it die ourselves (the
        orchestrator fails on a dead server too, but later) and stop its group even if it is orphaned."""
        for pid in replica.adopt_descendants():
            self.servers[pid] = replica
            self.deaths.watch(pid)

    def main(self) -> list[ManagedProcess]:
        """The trainer and the orchestrator, those this node runs: the run is over when they are."""
        return [c for c in (self.trainer, self.orchestrator) if c is not None]

    def first_failure(self) -> Failure | None:
        """What to blame, if anything failed: of the children that exited non-zero, or an inference child
        and its vLLM server that ended at all, the one that ended first (the others most likely failed on it)."""
        failed: list[Failure] = []
        for order, child in enumerate(self.processes):
            code = child.poll()
            if code not in (None, 0) or (child in self.replicas and code is not None):
                when = self._ended_at(child.pid)
                failed.append(Failure(when, order, child, f"{child.name} {child.ended_how()}", code))
        for pid, replica in self.servers.items():
            if pid in self.deaths.ended:
                cause = f"{replica.name}: its vLLM server (pid {pid}) died"
                failed.append(Failure(self.deaths.ended[pid], -1, replica, cause, None, pid))
        return min(failed) if failed else None

    def _ended_at(self, pid: int | None) -> float:
        ended = self.deaths.ended.get(pid, None) if pid is not None else None
        return time.monotonic() if ended is None else ended

    def wait(self, seconds: float) -> None:
        """Until a watched process dies or `seconds` pass. torchrun's workers start in sessions of their own:
        the trainer's new ones are adopted first, so that a stop reaches them."""
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.adopt_descendants()
        self.deaths.wait(seconds)

    def stop_main(self) -> None:
        """Trainer and orchestrator side by side (the trainer checkpoints on SIGTERM)."""
        if self.trainer is not None:
            self.trainer.adopt_descendants()
        stop_together([c for c in (self.trainer, self.orchestrator) if c is not None and c in self.processes])

    def stop_all(self) -> None:
        """Orchestrator and trainer side by side, then inference (the orchestrator must not see it vanish
        first and blame it); says how long each took, once."""
        if all(c.stop_seconds is not None for c in self.processes):
            return
        if self.trainer is not None:
            self.trainer.adopt_descendants()  # torchrun's workers run in sessions of their own
        stop_together([c for c in self.processes if c not in self.replicas])
        stop_together(self.replicas)
        took = ", ".join(f"{c.name} {c.stop_seconds:.1f} s" for c in self.processes)
        self._say(f"stopped {took}")

    def close(self) -> None:
        self.deaths.close()

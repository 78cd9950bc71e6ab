"""A real two-node Slurm cluster on this one host, for tests: munged, slurmctld and two slurmd daemons
(nodes n1 and n2, each on its own port), all state in one temp dir, every daemon started and stopped by
its pid. The clients (sbatch, squeue, scontrol, and the job's own) find it through SLURM_CONF."""

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
START_TIMEOUT = 60.0


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def slurm_conf(root: Path, user: str, host: str, ports: dict[str, int], cpus: int) -> str:
    """slurm.conf of the local cluster (pure): both nodes on this host at 127.0.0.1, distinct ports."""
    nodes = [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} Port={ports[name]} State=UNKNOWN"
        for name in NODES
    ]
    return "\n".join(
        [
            "ClusterName=tidaltest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports['slurmctld']}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            f"SlurmUser={user}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool_%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd_%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd_%n.log'}",
            *nodes,
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class LocalSlurm:
    root: Path
    processes: list[tuple[str, "subprocess.Popen[bytes]"]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "LocalSlurm":
        munge = self.root / "munge"
        for folder in (munge, self.root / "state", self.root / "log"):
            folder.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {name: _free_port() for name in ("slurmctld", *NODES)}
        cpus = os.cpu_count() or 1
        self.conf.write_text(
            slurm_conf(self.root, getpass.getuser(), socket.gethostname().split(".")[0], ports, cpus)
        )
        self._spawn(
            "munged", _program("munged"), "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
            f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
        )  # fmt: skip
        self._wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", _program("slurmctld"), "-D", "-f", str(self.conf))
        for name in NODES:
            self._spawn(f"slurmd {name}", _program("slurmd"), "-D", "-f", str(self.conf), "-N", name)
        self._wait_for(self._nodes_idle, "both nodes idle in sinfo")
        return self

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '_')}.out", "ab")  # noqa: SIM115 - the daemon's
        self.processes.append(
            (name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        )
        log.close()

    def _nodes_idle(self) -> bool:
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(name) == "idle" for name in NODES)

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            for name, process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {process.returncode}; see {self.root / 'log'}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"local Slurm: no {what} after {START_TIMEOUT:.0f} s; see {self.root / 'log'}"
                )
            time.sleep(0.2)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def job_state(self, job_id: str) -> str:
        """JobState of `scontrol show job` (PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, …)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
        return fields["JobState"]

    def cancel_all(self, timeout: float = 90.0) -> None:
        """Cancel every job left (a failed test's) and wait until they are gone, with their processes."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while (
            self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and time.monotonic() < deadline
        ):
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel what still runs, then SIGTERM each daemon we started (slurmd first, munged last) and
        SIGKILL what is left after 10 s."""
        if self.processes:
            self.cancel_all()
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()

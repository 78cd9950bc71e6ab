"""`tidal rl`: start inference (every replica, wait for all to be healthy), then trainer and orchestrator;
supervise; stop all cleanly.

Each child runs in its own process group with its output in `<output_dir>/logs/<name>.log`. The launcher
prints one line per step from the metrics files. If any child fails, or on Ctrl-C / SIGTERM, every child
is stopped (process groups, grandchildren included) and the launcher exits non-zero naming the culprit: the
process that ended first (the vLLM server under each `tidal inference` is watched too).
"""

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.errors import UserError
from tidal.launcher.process import DeathWatch, ManagedProcess, ProcessEnded, stop_together, wait_healthy
from tidal.launcher.split import RoleConfigs, split_config

POLL_SECONDS = 0.5


def write_config(config: BaseModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def tidal_argv(command: str, config_path: Path) -> list[str]:
    return [sys.executable, "-m", "tidal", command, "@", str(config_path)]


def trainer_argv(
    config_path: Path,
    num_ranks: int,
    num_nodes: int = 1,
    rendezvous: str | None = None,
    run_id: str = "tidal",
) -> list[str]:
    """The trainer's command: `tidal trainer` itself for one rank, else torchrun with `num_ranks` per node;
    on several nodes every node's torchrun joins the c10d rendezvous at `rendezvous` (host:port on the first
    trainer node) under `run_id`, and torchrun numbers the ranks."""
    if num_ranks == 1 and num_nodes == 1:
        return tidal_argv("trainer", config_path)
    if num_nodes == 1:
        where = ["--standalone"]
    else:
        assert rendezvous is not None, "several trainer nodes need a rendezvous endpoint"
        where = ["--nnodes", str(num_nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous,
                 "--rdzv-id", run_id]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(num_ranks),
        "-m", "tidal", "trainer", "@", str(config_path),
    ]  # fmt: skip


class StepReporter:
    """Tails the orchestrator's and trainer's metrics.jsonl and prints one line per finished step.

    On `--resume` the files already hold the earlier run's steps (printed by that run): reading starts at
    their current end. A resumed child rewrites its file without the steps it will redo (a new file under
    the same name): the reporter then skips the kept history and follows the new file. A line it cannot
    parse is skipped: the summary must never stop the run it reports on.
    """

    def __init__(self, output_dir: Path, max_steps: int):
        self.orchestrator = run_layout.orchestrator_dir(output_dir) / "metrics.jsonl"
        self.trainer = run_layout.trainer_dir(output_dir) / "metrics.jsonl"
        self.max_steps = max_steps
        self._files = {path: _file_identity(path) for path in (self.orchestrator, self.trainer)}
        self._orch: dict[int, dict[str, Any]] = {}

    def poll(self) -> None:
        # the orchestrator writes step n before the trainer can train on it: read it first
        for record in self._read_new(self.orchestrator):
            self._orch[record["step"]] = record
        for record in self._read_new(self.trainer):
            print(self._line(record), flush=True)

    def _line(self, record: dict[str, Any]) -> str:
        orch = self._orch.get(record["step"], {})
        return (
            f"step {record['step'] + 1}/{self.max_steps} | reward {orch.get('reward/mean', float('nan')):.3f}"
            f" | off-policy {orch.get('off_policy/max', '?')} | loss {record.get('loss', float('nan')):+.4f}"
            f" | trainer {record.get('tokens_per_s', 0) / 1e3:.1f}k tok/s"
            f" | inference {orch.get('tokens_per_s', 0):.0f} tok/s"
            f" | trainer waited {record.get('time/wait_for_data', 0):.2f} s"
        )

    def _read_new(self, path: Path) -> list[dict[str, Any]]:
        inode, offset = self._files[path]
        current = _file_identity(path)
        if current[0] is None:
            return []
        if inode is None:  # created since we started: all of it is new
            inode, offset = current[0], 0
        elif current[0] != inode or current[1] < offset:
            # rewritten by a resumed child: what it kept is history, already reported
            self._files[path] = current
            return []
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._files[path] = (inode, offset + len(complete))
        return [r for r in map(_parse, complete.decode(errors="replace").splitlines()) if r is not None]


def _file_identity(path: Path) -> tuple[int | None, int]:
    """(inode, size) of a file, (None, 0) while it does not exist."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None, 0
    return stat.st_ino, stat.st_size


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


class Launcher:
    """Owns the three children; `run()` returns the exit code of `tidal rl`."""

    def __init__(self, config: RLConfig):
        self.config = config
        self.out = config.output_dir
        self.children: list[ManagedProcess] = []
        self.replicas: list[ManagedProcess] = []
        """The `tidal inference` children, one per replica (also in `children`)."""
        self.servers: dict[int, ManagedProcess] = {}
        """The vLLM servers' pids, each with the `tidal inference` child that started it."""
        self.deaths = DeathWatch()
        self.stop_signal: int | None = None

    def run(self) -> int:
        self._check_output_dir()
        if self.config.resume:
            # before any child starts: trainer and orchestrator must not race over a killed run's leftovers
            run_layout.discard_after_checkpoint(self.out)
        on_gpu = _on_gpu()
        roles = split_config(self.config, on_gpu)
        paths = self._write_configs(roles)
        env = self._device_env(roles, on_gpu)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise(roles, paths, env)
        finally:
            self._stop_all()
            self.deaths.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_all(self) -> None:
        """Orchestrator and trainer side by side, then inference (the orchestrator must not see it vanish
        first and blame it); prints how long each took, once."""
        if all(c.stop_seconds is not None for c in self.children):
            return
        stop_together([c for c in self.children if c not in self.replicas])
        stop_together(self.replicas)
        took = ", ".join(f"{c.name} {c.stop_seconds:.1f} s" for c in self.children)
        print(f"tidal rl: stopped {took}", flush=True)

    def _supervise(self, roles: RoleConfigs, paths: dict[str, Path], env: dict[str, dict[str, str]]) -> int:
        from tidal.inference.server import check_port_free

        # before starting anything: a server already on that port would pass the health wait below
        for server in roles.replicas:
            check_port_free(server.server.host, server.server.port)
        logs = self.out / "logs"
        for index in range(len(roles.replicas)):
            name = replica_name(index, len(roles.replicas))
            child = self._start(name, tidal_argv("inference", paths[name]), logs, env[name])
            self.replicas.append(child)
        what = f"{len(roles.replicas)} inference replicas" if len(roles.replicas) > 1 else "inference"
        print(f"tidal rl: starting {what} ({roles.inference.model.name}); logs in {logs}/", flush=True)
        self._wait_healthy(roles)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        # each vLLM server runs in its own session under `tidal inference`: watch it die ourselves (the
        # orchestrator fails on a dead server too, but later) and stop its group even if it is orphaned
        for replica in self.replicas:
            for pid in replica.adopt_descendants():
                self.servers[pid] = replica
                self.deaths.watch(pid)
        self._start(
            "trainer",
            trainer_argv(paths["trainer"], self.config.deployment.num_trainer_ranks),
            logs,
            env["trainer"],
        )
        self._start(
            "orchestrator", tidal_argv("orchestrator", paths["orchestrator"]), logs, env["orchestrator"]
        )
        are = "are" if len(roles.replicas) > 1 else "is"
        print(f"tidal rl: {what} {are} up; trainer and orchestrator started", flush=True)
        reporter = StepReporter(self.out, self.config.max_steps)
        while True:
            reporter.poll()
            if self.stop_signal is not None:
                print(f"tidal rl: signal {self.stop_signal}: stopping every process", file=sys.stderr)
                return 128 + self.stop_signal
            failure = self._first_failure()
            if failure is not None:
                self._stop_all()  # first: the culprit's log then ends with what it said while stopping
                raise UserError(failure)
            if all(c.poll() == 0 for c in self.children if c not in self.replicas):
                reporter.poll()
                return 0
            self.deaths.wait(POLL_SECONDS)

    def _first_failure(self) -> str | None:
        """What to blame, if anything failed: of the children that exited non-zero, or an inference child
        and its vLLM server that ended at all, the one that ended first (the others most likely failed on it)."""
        failed: list[tuple[float, int, str]] = []
        for order, child in enumerate(self.children):
            code = child.poll()
            if code not in (None, 0) or (child in self.replicas and code is not None):
                failed.append((self._ended_at(child.pid), order, self._failure(child)))
        for pid, replica in self.servers.items():
            if pid in self.deaths.ended:
                failed.append((self.deaths.ended[pid], -1, self._server_failure(replica, pid)))
        return min(failed)[2] if failed else None

    def _ended_at(self, pid: int | None) -> float:
        return self.deaths.ended.get(pid, float("inf")) if pid is not None else float("inf")

    def _start(self, name: str, argv: list[str], logs: Path, env: dict[str, str]) -> ManagedProcess:
        child = ManagedProcess(name, argv, logs / f"{name}.log", env).start()
        self.children.append(child)
        if child.pid is not None:
            self.deaths.watch(child.pid)
        return child

    def _wait_healthy(self, roles: RoleConfigs) -> None:
        """Until every replica answers /health; a replica that exits meanwhile fails the run at once."""
        targets = dict(zip(roles.orchestrator.client.urls, self.replicas, strict=True))
        try:
            left = wait_healthy(targets, self.config.startup_timeout, lambda: self.stop_signal is not None)
        except ProcessEnded as ended:
            raise UserError(self._failure(ended.child)) from None
        if left and self.stop_signal is None:
            url, replica = next(iter(left.items()))
            raise UserError(
                f"{replica.name} not healthy at {url}/health after {self.config.startup_timeout:.0f} s; "
                f"see {replica.log_path}"
            )

    def _failure(self, child: ManagedProcess) -> str:
        tail = child.log_tail(20)
        return f"{child.name} {child.ended_how()}; last lines of {child.log_path}:\n{tail}"

    def _server_failure(self, replica: ManagedProcess, pid: int) -> str:
        tail = replica.log_tail(20)
        return f"{replica.name}: its vLLM server (pid {pid}) died; last lines of {replica.log_path}:\n{tail}"

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _check_output_dir(self) -> None:
        metrics = run_layout.orchestrator_dir(self.out) / "metrics.jsonl"
        if not self.config.resume and metrics.exists():
            raise UserError(
                f"output_dir {self.out} already holds a run; pass --resume or choose another --output-dir"
            )

    def _write_configs(self, roles: RoleConfigs) -> dict[str, Path]:
        configs = self.out / "configs"
        paths = {
            "orchestrator": write_config(roles.orchestrator, configs / "orchestrator.toml"),
            "trainer": write_config(roles.trainer, configs / "trainer.toml"),
        }
        for index, replica in enumerate(roles.replicas):
            name = replica_name(index, len(roles.replicas))
            paths[name] = write_config(replica, configs / f"{name}.toml")
        return paths

    def _device_env(self, roles: RoleConfigs, on_gpu: bool) -> dict[str, dict[str, str]]:
        base = {"PYTHONUNBUFFERED": "1"}
        names = [replica_name(i, len(roles.replicas)) for i in range(len(roles.replicas))]
        if not on_gpu:
            cpu = {"trainer": {**base, "CUDA_VISIBLE_DEVICES": ""}, "orchestrator": base}
            return {**cpu, **{name: base for name in names}}
        env = {
            "trainer": {**base, "CUDA_VISIBLE_DEVICES": _devices(self.config.deployment.trainer_gpus)},
            "orchestrator": {**base, "CUDA_VISIBLE_DEVICES": ""},
        }
        for name, gpus in zip(names, roles.replica_gpus, strict=True):
            env[name] = {**base, "CUDA_VISIBLE_DEVICES": _devices(gpus)}
        return env


def replica_name(index: int, count: int) -> str:
    """`inference` for a single replica (its log is logs/inference.log), else `inference_<index>`."""
    return "inference" if count == 1 else f"inference_{index}"


def _devices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def _on_gpu() -> bool:
    from tidal.inference.server import vllm_flavour

    return vllm_flavour() == "cuda"


def dry_run(config: RLConfig) -> str:
    """The resolved config of every process `tidal rl` would start, as the TOML files it would write."""
    roles = split_config(config, _on_gpu())
    count = len(roles.replicas)
    named: list[tuple[str, BaseModel]] = [(replica_name(i, count), r) for i, r in enumerate(roles.replicas)]
    named += [("orchestrator", roles.orchestrator), ("trainer", roles.trainer)]
    parts = []
    for name, role in named:
        body = tomli_w.dumps(role.model_dump(mode="json", exclude_none=True))
        parts.append(f"# ---- {config.output_dir}/configs/{name}.toml ----\n{body}")
    return "\n".join(parts)


def main(config: RLConfig) -> int:
    if config.deployment.type != "local":
        raise UserError(
            f'deployment.type = {config.deployment.type!r} is not supported yet; use "local"'
        )  # TODO(issue 13): render and submit the job instead
    start = time.perf_counter()
    code = Launcher(config).run()
    if code == 0:
        from tidal.monitor.plot import plot_rl_run

        plot = plot_rl_run(config.output_dir)
        print(f"tidal rl: done in {time.perf_counter() - start:.0f} s; plot: {plot}", flush=True)
    return code

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.deploy.plan import ORCHESTRATOR, TRAINER, place
from tidal.errors import UserError
from tidal.launcher.argv import tidal_argv, torchrun_argv
from tidal.launcher.process import DeathWatch, ManagedProcess, ProcessEnded, stop_together, wait_healthy
from tidal.launcher.split import RoleConfigs, split_config

POLL_SECONDS = 0.5


def write_config(config: BaseModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def trainer_argv(
    config_path: Path,
    num_ranks: int,
    num_nodes: int = 1,
    rendezvous: str | None = None,
    run_id: str = "tidal",
    local_addr: str | None = None,
    is_host: bool | None = None,
) -> list[str]:
    """The trainer's command: `tidal trainer` itself for one rank, else torchrun with `num_ranks` per node
    (tidal.launcher.argv.torchrun_argv: on several nodes joined by a c10d rendezvous)."""
    if num_ranks == 1 and num_nodes == 1:
        return tidal_argv("trainer", config_path)
    return torchrun_argv(
        "trainer", config_path, num_ranks, num_nodes, rendezvous, run_id, local_addr, is_host
    )


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


@dataclass(frozen=True)
class ClusterNode:
    """The node a `Launcher` runs in a cluster run (`tidal node`): its index (tidal.deploy.plan), every
    node's address by index, its name for messages, and the run's id (torchrun's rendezvous id; the
    done markers of one run are told from an earlier one's by it)."""

    index: int
    addresses: tuple[str, ...]
    name: str
    run_id: str

    @property
    def label(self) -> str:
        return f"node {self.index} ({self.name})"


class Launcher:
    """Owns the children; `run()` returns the exit code of `tidal rl` (or of `tidal node`).

    Without `node` it runs every role on this machine. With `node` it runs that node's roles of a cluster
    run: its inference replicas, its trainer node's torchrun, the orchestrator if placed there; logs and
    configs are then named `<name>_node<K>`. A node with the trainer or the orchestrator ends when they
    have; a node with replicas ends when every such node has marked itself done in the output dir."""

    def __init__(self, config: RLConfig, node: ClusterNode | None = None):
        self.config = config
        self.node = node
        self.out = config.output_dir
        self.placement = place(config.deployment)
        self.index = node.index if node is not None else 0
        self.here = self.placement.roles(self.index)
        self.prefix = "tidal rl" if node is None else f"tidal {node.label}"
        self.suffix = "" if node is None else f"_node{self.index}"
        self.children: list[ManagedProcess] = []
        self.replicas: list[ManagedProcess] = []
        """The `tidal inference` children, one per replica (also in `children`)."""
        self.trainer: ManagedProcess | None = None
        self.servers: dict[int, ManagedProcess] = {}
        """The vLLM servers' pids, each with the `tidal inference` child that started it."""
        self.deaths = DeathWatch()
        self.stop_signal: int | None = None
        self.started = 0.0
        """When this node started the run, as the output dir's storage stamps it (cluster runs)."""

    def run(self) -> int:
        if ORCHESTRATOR in self.here:
            self._check_output_dir()
        if self.node is not None:
            self.started = run_layout.mark_node(self.out, self.index, "started", self.node.run_id)
        if self.config.resume and self._hosts_trainer_rendezvous():
            # before any trainer starts (the other trainer nodes wait for this one's rendezvous): the
            # checkpoint is verified (not found broken once vLLM is up), and trainer and orchestrator must
            # not race over a killed run's leftovers
            run_layout.prepare_resume(self.out, lambda line: print(f"tidal rl: {line}", flush=True))
        on_gpu = _on_gpu()
        addresses = self.node.addresses if self.node is not None else None
        roles = split_config(self.config, on_gpu, addresses=addresses)
        local = roles.node_replicas(self.index)
        paths = self._write_configs(roles, local)
        env = self._device_env(roles, on_gpu, local)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise(roles, local, paths, env)
        finally:
            self._stop_all()
            self.deaths.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _hosts_trainer_rendezvous(self) -> bool:
        return TRAINER in self.here and self.placement.trainer_node_rank(self.index) == 0

    def _stop_all(self) -> None:
        """Orchestrator and trainer side by side, then inference (the orchestrator must not see it vanish
        first and blame it); prints how long each took, once."""
        if all(c.stop_seconds is not None for c in self.children):
            return
        if self.trainer is not None:
            self.trainer.adopt_descendants()  # torchrun's workers run in sessions of their own
        stop_together([c for c in self.children if c not in self.replicas])
        stop_together(self.replicas)
        took = ", ".join(f"{c.name} {c.stop_seconds:.1f} s" for c in self.children)
        print(f"{self.prefix}: stopped {took}", flush=True)

    def _supervise(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> int:
        from tidal.inference.server import check_port_free

        # before starting anything: a server already on that port would pass the health wait below
        for index in local:
            check_port_free(roles.replicas[index].server.host, roles.replicas[index].server.port)
        logs = self.out / "logs"
        urls = roles.orchestrator.client.urls
        waiting: dict[str, ManagedProcess | None] = {}
        for index in local:
            name = replica_name(index, len(roles.replicas))
            child = self._start(name, tidal_argv("inference", paths[name]), logs, env[name])
            self.replicas.append(child)
            waiting[urls[index]] = child
        if ORCHESTRATOR in self.here:  # the other nodes' replicas too: the orchestrator needs every one
            waiting.update({url: None for url in urls if url not in waiting})
        if local:
            what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
            print(
                f"{self.prefix}: starting {what} ({roles.inference.model.name}); logs in {logs}/", flush=True
            )
        self._wait_healthy(waiting)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        # each vLLM server runs in its own session under `tidal inference`: watch it die ourselves (the
        # orchestrator fails on a dead server too, but later) and stop its group even if it is orphaned
        for replica in self.replicas:
            for pid in replica.adopt_descendants():
                self.servers[pid] = replica
                self.deaths.watch(pid)
        if TRAINER in self.here:
            self.trainer = self._start("trainer", self._trainer_argv(paths["trainer"]), logs, env["trainer"])
        if ORCHESTRATOR in self.here:
            self._start(
                "orchestrator", tidal_argv("orchestrator", paths["orchestrator"]), logs, env["orchestrator"]
            )
        self._say_started(len(urls), local)
        reporter = StepReporter(self.out, self.config.max_steps) if ORCHESTRATOR in self.here else None
        main = [c for c in self.children if c not in self.replicas]
        marked = False
        while True:
            if reporter is not None:
                reporter.poll()
            if self.stop_signal is not None:
                print(f"{self.prefix}: signal {self.stop_signal}: stopping every process", file=sys.stderr)
                return 128 + self.stop_signal
            failure = self._first_failure()
            if failure is not None:
                self._stop_all()  # first: the culprit's log then ends with what it said while stopping
                raise UserError(failure if self.node is None else f"{self.node.label}: {failure}")
            if all(c.poll() == 0 for c in main):
                if reporter is not None:
                    reporter.poll()
                if self.node is None:
                    return 0
                if main and not marked:
                    run_layout.mark_node(self.out, self.index, "done", self.node.run_id)
                    marked = True
                if not self.replicas or self._main_nodes_done():
                    return 0
            if self.trainer is not None and self.trainer.poll() is None:
                self.trainer.adopt_descendants()
            self.deaths.wait(POLL_SECONDS)

    def _trainer_argv(self, config_path: Path) -> list[str]:
        deploy, node = self.config.deployment, self.node
        if node is None:
            return trainer_argv(config_path, deploy.num_trainer_ranks)
        first = self.placement.trainer_nodes[0]
        return trainer_argv(
            config_path,
            deploy.num_trainer_ranks,
            num_nodes=len(self.placement.trainer_nodes),
            rendezvous=f"{node.addresses[first]}:{deploy.rendezvous_port}",
            run_id=node.run_id,
            local_addr=node.addresses[self.index],
            is_host=self.index == first,
        )

    def _say_started(self, num_replicas: int, local: list[int]) -> None:
        started = [role for role in (TRAINER, ORCHESTRATOR) if role in self.here]
        if self.node is None:
            are = "are" if len(local) > 1 else "is"
            what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
            print(f"{self.prefix}: {what} {are} up; trainer and orchestrator started", flush=True)
        elif started:
            print(
                f"{self.prefix}: {' and '.join(started)} started"
                + (f" ({num_replicas} inference replicas up)" if ORCHESTRATOR in self.here else ""),
                flush=True,
            )
        else:
            print(
                f"{self.prefix}: {len(local)} inference replica(s) up; serving until the run ends", flush=True
            )

    def _main_nodes_done(self) -> bool:
        """Whether every node with the trainer or the orchestrator has finished this run."""
        assert self.node is not None
        nodes = {*self.placement.trainer_nodes, self.placement.orchestrator_node}
        return all(run_layout.node_done(self.out, n, self.node.run_id, self.started) for n in nodes)

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
        child = ManagedProcess(name, argv, logs / f"{name}{self.suffix}.log", env).start()
        self.children.append(child)
        if child.pid is not None:
            self.deaths.watch(child.pid)
        return child

    def _wait_healthy(self, waiting: dict[str, ManagedProcess | None]) -> None:
        """Until every URL in `waiting` answers /health; a replica of ours (the value; None: another
        node's) that exits meanwhile fails the run at once."""
        try:
            left = wait_healthy(waiting, self.config.startup_timeout, lambda: self.stop_signal is not None)
        except ProcessEnded as ended:
            raise UserError(self._failure(ended.child)) from None
        if left and self.stop_signal is None:
            url, replica = next(iter(left.items()))
            what = f"{replica.name} not healthy" if replica is not None else "inference replica not healthy"
            where = f"; see {replica.log_path}" if replica is not None else " (it runs on another node)"
            raise UserError(f"{what} at {url}/health after {self.config.startup_timeout:.0f} s{where}")

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

    def _write_configs(self, roles: RoleConfigs, local: list[int]) -> dict[str, Path]:
        configs = self.out / "configs"
        paths = {}
        if ORCHESTRATOR in self.here:
            paths["orchestrator"] = write_config(
                roles.orchestrator, configs / f"orchestrator{self.suffix}.toml"
            )
        if TRAINER in self.here:
            paths["trainer"] = write_config(roles.trainer, configs / f"trainer{self.suffix}.toml")
        for index in local:
            name = replica_name(index, len(roles.replicas))
            paths[name] = write_config(roles.replicas[index], configs / f"{name}{self.suffix}.toml")
        return paths

    def _device_env(self, roles: RoleConfigs, on_gpu: bool, local: list[int]) -> dict[str, dict[str, str]]:
        base = {"PYTHONUNBUFFERED": "1"}
        names = {index: replica_name(index, len(roles.replicas)) for index in local}
        if not on_gpu:
            cpu = {"trainer": {**base, "CUDA_VISIBLE_DEVICES": ""}, "orchestrator": base}
            return {**cpu, **{name: base for name in names.values()}}
        env = {
            "trainer": {**base, "CUDA_VISIBLE_DEVICES": _devices(self.config.deployment.trainer_gpus)},
            "orchestrator": {**base, "CUDA_VISIBLE_DEVICES": ""},
        }
        for index, name in names.items():
            env[name] = {**base, "CUDA_VISIBLE_DEVICES": _devices(roles.replica_gpus[index])}
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
    """The resolved config of every process `tidal rl` would start, as the TOML files it would write;
    on Slurm, the batch script and the run config it would submit; on Kubernetes, the manifests it writes
    (tidal.deploy.kubernetes), listed."""
    if config.deployment.type == "slurm":
        from tidal.deploy import slurm

        return slurm.dry_run(config)
    if config.deployment.type == "kubernetes":
        from tidal.deploy import kubernetes

        return kubernetes.dry_run(config)
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
    if config.deployment.type == "slurm":
        from tidal.deploy import slurm

        return slurm.submit(config)
    if config.deployment.type == "kubernetes":
        from tidal.deploy import kubernetes

        return kubernetes.launch(config)
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

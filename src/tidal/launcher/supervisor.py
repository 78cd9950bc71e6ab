"""The supervision both kinds of `tidal rl` launcher share (tidal.launcher.rl.LocalLauncher, every role on
this machine; tidal.launcher.node.NodeLauncher, one node's roles of a cluster run).

`Supervisor.run` writes this node's role configs, starts its inference replicas and, while they load, the
orchestrator and a trainer that shares no GPU with them; once every replica is healthy, a trainer that
does. Then it watches: reports the steps (tidal.launcher.report), restarts what fails or stops the run
(tidal.launcher.restarter), and ends on SIGINT/SIGTERM or once the node's part is done (the subclass says
when), stopping every child (tidal.launcher.children). What differs between the two kinds is a handful of
hooks: the trainer's command, the "started" line, and when the node is done.
"""

import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from pathlib import Path

import tomli_w
from pydantic import BaseModel

from tidal import run_layout
from tidal.config.inference import ADMIN_TOKEN_ENV, InferenceConfig
from tidal.config.rl import RLConfig
from tidal.errors import UserError
from tidal.inference.disagg import empty_store, storage_of
from tidal.launcher.argv import tidal_argv
from tidal.launcher.children import Children
from tidal.launcher.plan import ORCHESTRATOR, TRAINER, place
from tidal.launcher.report import RunReport
from tidal.launcher.restarter import Restarter
from tidal.launcher.split import RoleConfigs, run_admin_token, split_config
from tidal.process import ManagedProcess, ProcessEnded, wait_healthy

TEACHER = "teacher"
"""The child serving the distillation teacher (`[teacher_server]`), and its log and config file's name."""
POLL_SECONDS = 0.5
STATUS_SECONDS = 15.0
"""How often the launcher says what it still waits for (vLLM loading, the first step)."""


class Supervisor(ABC):
    """Owns one node's children; `run()` returns the exit code of `tidal rl` (or of `tidal node`).

    `index`: the node (0 on one machine); `prefix` starts the launcher's lines; `suffix` ends the names of
    the node's logs and configs; `addresses`: every node's address in a cluster run, else None. Subclasses
    give what happens before the start (`_begin`), the trainer's command (`_trainer_argv`), the line once
    the roles are up (`_started_line`) and when the node may end once its trainer and orchestrator have
    (`_may_end`)."""

    def __init__(
        self,
        config: RLConfig,
        index: int,
        prefix: str,
        suffix: str,
        node_label: str | None = None,
        addresses: Sequence[str] | None = None,
    ):
        self.config = config
        self.out = config.output_dir
        self.placement = place(config.deployment)
        self.index = index
        self.here = self.placement.roles(index)
        self.suffix = suffix
        self.addresses = addresses
        self.report = RunReport(config, prefix, node_label)
        self.children = Children(self.out / "logs", suffix, self.report.say)
        hosts_rendezvous = self._hosts_trainer_rendezvous()
        self.restarts = Restarter(config, self.children, self.report, self.here, hosts_rendezvous, node_label)
        self.stop_signal: int | None = None
        self.gate: Path | None = None
        """The gate file of a trainer started while vLLM loads on its GPU (`_start_while_loading`)."""

    # ---- what the two kinds of launcher do differently -------------------------------------------------

    @abstractmethod
    def _begin(self) -> None:
        """Before anything is split or started (after the output dir's check)."""

    @abstractmethod
    def _trainer_argv(self, config_path: Path) -> list[str]:
        """The trainer's command (torchrun around `tidal trainer` for several ranks)."""

    @abstractmethod
    def _started_line(self, num_replicas: int, local: list[int], started: list[str], roles: str) -> str:
        """The line once every replica is up: `roles` says which of `started` (trainer, orchestrator) came
        up while vLLM loaded."""

    @abstractmethod
    def _may_end(self) -> bool:
        """Whether the run is over for this node, its trainer and orchestrator (those it has) done."""

    # ---- the run -------------------------------------------------------------------------------------

    def run(self) -> int:
        if ORCHESTRATOR in self.here:
            self._check_output_dir()
        self._begin()
        if self.config.resume and self._hosts_trainer_rendezvous():
            # before any trainer starts (the other trainer nodes wait for this one's rendezvous): the
            # checkpoint is verified (not found broken once vLLM is up), and trainer and orchestrator must
            # not race over a killed run's leftovers
            run_layout.prepare_resume(self.out, self.report.say)
        on_gpu = gpu_run()
        roles = split_config(self.config, on_gpu, addresses=self.addresses)
        local = roles.node_replicas(self.index)
        if local:  # before anything starts: a server that cannot return routes would fail only minutes later
            from tidal.inference.server import check_route_return

            check_route_return(roles.inference, "cuda" if on_gpu else "cpu")
        paths = self._write_configs(roles, local)
        env = self._child_env(roles, on_gpu, local)
        kv_store = kv_store_of(roles, local)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            code = self._supervise(roles, local, paths, env)
            return code
        finally:
            self.children.stop_all()
            if kv_store is not None:  # prompt KV of the last weights: of no use to a later run
                empty_store(kv_store)
            self.report.close(code)
            self.children.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _hosts_trainer_rendezvous(self) -> bool:
        return TRAINER in self.here and self.placement.trainer_node_rank(self.index) == 0

    def _supervise(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> int:
        """Start this node's roles, replicas first and what need not wait for them while they load, then
        watch them until the run ends; its exit code."""
        waiting = self._start_replicas(roles, local, paths, env)
        early = self._start_while_loading(roles, local, paths, env)
        if ORCHESTRATOR in self.here:  # while vLLM loads: W&B takes seconds to start too
            self.report.follow_steps()
        self._wait_healthy(waiting)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        for replica in self.children.replicas:
            self.children.watch_servers(replica)
        self._open_gate()
        if TRAINER in self.here and self.children.trainer is None:
            self._start_trainer(paths, env)
        started = [role for role in (TRAINER, ORCHESTRATOR) if role in self.here]
        roles_line = started_roles(started, {child.name for child in early})
        self.report.say(self._started_line(len(roles.replica_urls), local, started, roles_line))
        return self._watch()

    def _start_replicas(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> dict[str, ManagedProcess | None]:
        """Start this node's replicas; every URL to wait for, with its replica (None: another node's)."""
        from tidal.inference.server import check_port_free

        # before starting anything: a server already on that port would pass the health wait below
        for index in local:
            check_port_free(roles.replicas[index].server.host, roles.replicas[index].server.port)
        urls = roles.replica_urls
        waiting: dict[str, ManagedProcess | None] = {}
        if roles.teacher is not None and ORCHESTRATOR in self.here:
            waiting.update(self._start_teacher(roles.teacher, paths, env))
        for index in local:
            name = replica_name(index, len(roles.replicas))
            child = self.children.start(name, tidal_argv("inference", paths[name]), env[name])
            self.children.replicas.append(child)
            self.restarts.urls[name] = urls[index]
            self.restarts.up.add(name)  # healthy below, or the run stops
            waiting[urls[index]] = child
        if ORCHESTRATOR in self.here:  # the other nodes' replicas too: the orchestrator needs every one
            waiting.update({url: None for url in urls if url not in waiting})
        if local:
            what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
            self.report.say(f"starting {what} ({roles.inference.model.name}); logs in {self.children.logs}/")
        return waiting

    def _start_teacher(
        self, teacher: InferenceConfig, paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> dict[str, ManagedProcess | None]:
        """The distillation teacher's server (`[teacher_server]`): watched, restarted and stopped as a replica is
        (it gets no weights: the orchestrator's client does not know it, only its teacher client does)."""
        from tidal.inference.server import check_port_free, client_url

        check_port_free(teacher.server.host, teacher.server.port)
        child = self.children.start(TEACHER, tidal_argv("inference", paths[TEACHER]), env[TEACHER])
        self.children.replicas.append(child)
        url = client_url(teacher.server.host, teacher.server.port)
        self.restarts.urls[TEACHER] = url
        self.restarts.up.add(TEACHER)
        self.report.say(f"starting the teacher ({teacher.model.name}) at {url}")
        return {url: child}

    def _start_while_loading(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> list[ManagedProcess]:
        """Start what need not wait for vLLM, so that its start-up (imports, loading and sharding the model)
        overlaps vLLM's: the orchestrator always (it uses no GPU and waits for /health itself), the trainer
        too. A trainer that shares a GPU with this node's replicas waits before its first CUDA call until
        they are up (`run_layout.trainer_gate`, opened by `_open_gate`): vLLM sizes its cache from the memory
        free while it starts, so a trainer allocating on the same GPU then could make it fail or take too
        little."""
        # (replica_gpus is empty on a machine without GPUs: nothing to share)
        replica_gpus = {gpu for index in local if roles.replica_gpus for gpu in roles.replica_gpus[index]}
        started: list[ManagedProcess] = []
        for role in roles_while_loading(self.here, replica_gpus, self.config.deployment.trainer_gpus):
            if role == ORCHESTRATOR:
                argv = tidal_argv("orchestrator", paths["orchestrator"])
                self.children.orchestrator = self.children.start("orchestrator", argv, env["orchestrator"])
                started.append(self.children.orchestrator)
            elif role == TRAINER:
                started.append(self._start_trainer(paths, env))
            else:  # GATED_TRAINER
                self.gate = run_layout.trainer_gate(self.out, self.suffix)
                self.gate.unlink(missing_ok=True)  # a resumed run's, opened before this start
                self.gate.parent.mkdir(parents=True, exist_ok=True)
                gated = {**env, TRAINER: {**env[TRAINER], run_layout.TRAINER_GATE_ENV: str(self.gate)}}
                started.append(self._start_trainer(paths, gated))
        return started

    def _open_gate(self) -> None:
        """Every replica of this node is up: the trainer this node holds at its gate may touch the GPU now
        (restarted, with the same environment, it finds the gate open)."""
        if self.gate is not None:
            self.gate.touch()

    def _start_trainer(self, paths: dict[str, Path], env: dict[str, dict[str, str]]) -> ManagedProcess:
        argv = self._trainer_argv(paths["trainer"])
        self.children.trainer = self.children.start("trainer", argv, env["trainer"])
        return self.children.trainer

    def _wait_healthy(self, waiting: dict[str, ManagedProcess | None]) -> None:
        """Until every URL in `waiting` answers /health; a replica of ours (the value; None: another
        node's) that exits meanwhile fails the run at once. A trainer or orchestrator started while vLLM
        loads that fails meanwhile is left to the supervision loop after the wait (restarted or named
        there, as when it fails later): ending the wait early would start a trainer that shares vLLM's GPU
        while vLLM still sizes its cache."""
        reminder = _Reminder(STATUS_SECONDS)

        def still_waiting(left: dict[str, ManagedProcess | None]) -> None:
            if reminder.due():
                names = ", ".join(c.name if c is not None else url for url, c in left.items())
                self.report.say(
                    f"waiting for vLLM ({names}) to load: {reminder.elapsed():.0f} s "
                    f"(startup_timeout {self.config.startup_timeout:.0f} s)"
                )

        try:
            left = wait_healthy(
                waiting,
                self.config.startup_timeout,
                lambda: self.stop_signal is not None,
                on_poll=still_waiting,
            )
        except ProcessEnded as ended:
            raise UserError(ended_with_log(ended.child)) from None
        if left and self.stop_signal is None:
            url, replica = next(iter(left.items()))
            what = f"{replica.name} not healthy" if replica is not None else "inference replica not healthy"
            where = f"; see {replica.log_path}" if replica is not None else " (it runs on another node)"
            raise UserError(f"{what} at {url}/health after {self.config.startup_timeout:.0f} s{where}")

    def _watch(self) -> int:
        """Until the run ends: each pass reports the steps trained, restarts a role that failed (or stops
        the run, raising its error), and ends on a signal or once this node's part is done; the exit code."""
        first_step = _Reminder(STATUS_SECONDS)
        while True:
            self._follow(first_step)
            if self.stop_signal is not None:
                self.report.stopping_on_signal(self.stop_signal)
                return 128 + self.stop_signal
            failure = self.children.first_failure()
            if failure is not None:
                self.restarts.recover(failure)  # or stop the run
                continue  # look again at once: the next failure, or the restarted children
            self.restarts.check_restarted_replicas()
            if all(c.poll() == 0 for c in self.children.main()):
                self.report.last_steps()
                self.restarts.end_recoveries()
                if self._may_end():
                    return 0
            self.children.wait(POLL_SECONDS)

    def _follow(self, first_step: "_Reminder") -> None:
        """The steps trained since the last look: reported, and read for which roles got going and which
        recoveries are done; until the first one, now and then a line saying what the run waits for."""
        self.report.poll()
        self.restarts.follow_progress()
        if TRAINER not in self.restarts.up and self.report.steps is not None and first_step.due():
            self.report.say(
                f"waiting for the first step: {first_step.elapsed():.0f} s since inference came up (the "
                f"trainer loading the model, the first rollouts); logs in {self.children.logs}/"
            )

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
        if roles.teacher is not None and ORCHESTRATOR in self.here:
            paths[TEACHER] = write_config(roles.teacher, configs / f"{TEACHER}{self.suffix}.toml")
        return paths

    def _child_env(self, roles: RoleConfigs, on_gpu: bool, local: list[int]) -> dict[str, dict[str, str]]:
        """Each child's extra environment: its devices and, for the replicas and the orchestrator, the run's
        admin token (never in a file: the configs written to the output dir have none)."""
        token = run_admin_token(self.config, os.environ, shared=self.addresses is not None)
        trainer_gpus = self.config.deployment.trainer_gpus
        return with_admin_token(device_env(roles, on_gpu, local, trainer_gpus), token)


class _Reminder:
    """Due every `seconds` from its creation: for the launcher's "still waiting" lines."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()
        self._next = self.start + seconds

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def write_config(config: BaseModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def ended_with_log(child: ManagedProcess) -> str:
    """`<name> exited with code 1; last lines of <log>:` and those lines."""
    tail = child.log_tail(20)
    return f"{child.name} {child.ended_how()}; last lines of {child.log_path}:\n{tail}"


GATED_TRAINER = "trainer (held before the GPU)"
"""`roles_while_loading`'s name for a trainer that starts while vLLM loads on its GPU but waits at the gate."""


def roles_while_loading(
    here: Collection[str], replica_gpus: set[int], trainer_gpus: Sequence[int]
) -> list[str]:
    """Of this node's roles, those that start while its vLLM replicas load: the orchestrator (no GPU) and
    the trainer, as GATED_TRAINER where it shares a GPU with a replica (on a machine without GPUs it
    shares none)."""
    early = [ORCHESTRATOR] if ORCHESTRATOR in here else []
    if TRAINER in here:
        early.append(TRAINER if replica_gpus.isdisjoint(trainer_gpus) else GATED_TRAINER)
    return early


def started_roles(started: Sequence[str], early: set[str]) -> str:
    """`trainer and orchestrator started while vLLM loaded`, or which did and which started only now."""
    parts = []
    while_loading = [role for role in started if role in early]
    if while_loading:
        parts.append(f"{' and '.join(while_loading)} started while vLLM loaded")
    now = [role for role in started if role not in early]
    if now:
        parts.append(f"{' and '.join(now)} started")
    return "; ".join(parts)


def kv_store_of(roles: RoleConfigs, local: list[int]) -> Path | None:
    """The shared KV store of this node's disaggregated replicas (ExampleConnector), emptied before they
    start: KV an earlier run (or the run being resumed) computed belongs to other weights."""
    store = storage_of([roles.replicas[i] for i in local])
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
        empty_store(store)
    return store


def device_env(
    roles: RoleConfigs, on_gpu: bool, local: list[int], trainer_gpus: Sequence[int]
) -> dict[str, dict[str, str]]:
    """Each child's devices (CUDA_VISIBLE_DEVICES; none at all on CPU) and unbuffered output."""
    base = {"PYTHONUNBUFFERED": "1"}
    names = {index: replica_name(index, len(roles.replicas)) for index in local}
    if not on_gpu:
        cpu = {"trainer": {**base, "CUDA_VISIBLE_DEVICES": ""}, "orchestrator": base}
        teacher = {TEACHER: base} if roles.teacher is not None else {}
        return {**cpu, **teacher, **{name: base for name in names.values()}}
    env = {
        "trainer": {**base, "CUDA_VISIBLE_DEVICES": _devices(trainer_gpus)},
        "orchestrator": {**base, "CUDA_VISIBLE_DEVICES": ""},
    }
    for index, name in names.items():
        env[name] = {**base, "CUDA_VISIBLE_DEVICES": _devices(roles.replica_gpus[index])}
    if roles.teacher is not None:
        env[TEACHER] = {**base, "CUDA_VISIBLE_DEVICES": _devices(roles.teacher_gpus)}
    return env


def with_admin_token(env: dict[str, dict[str, str]], token: str | None) -> dict[str, dict[str, str]]:
    """Each child's environment, the admin token added for the replicas and the orchestrator (the trainer
    calls no admin route). The launcher keeps these environments for restarts: a restarted replica or
    orchestrator gets the same token as the rest of the run."""
    if token is None:
        return env
    return {
        name: {**values, ADMIN_TOKEN_ENV: token} if name != TRAINER else dict(values)
        for name, values in env.items()
    }


def replica_name(index: int, count: int) -> str:
    """`inference` for a single replica (its log is logs/inference.log), else `inference_<index>`."""
    return "inference" if count == 1 else f"inference_{index}"


def _devices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def gpu_run() -> bool:
    """Whether the vLLM installed is the CUDA build (the run's processes then go on GPUs)."""
    from tidal.inference.server import vllm_flavour

    return vllm_flavour() == "cuda"

"""`tidal rl`: start inference (every replica) and, while it loads, the orchestrator and a trainer that shares
no GPU with it; once every replica is healthy, a trainer that does; supervise, restarting what dies; stop all
cleanly.

Each child runs in its own process group with its output in `<output_dir>/logs/<name>.log`. The launcher
prints one line per step from the metrics files. A child that fails (the vLLM server under each
`tidal inference` is watched too) is restarted in place, within `[restarts]`: a replica on its port (the
orchestrator's client routes around it meanwhile and brings it to the latest weights on return), the
trainer from its latest checkpoint (the batches since are still on disk), the orchestrator from its own
state; each failure and recovery is one line here and a record in `<output_dir>/events.jsonl`. Past the
limit, or on Ctrl-C / SIGTERM, every child is stopped (process groups, grandchildren included) and the
launcher exits non-zero naming the culprit: the process that ended first.
"""

import os
import signal
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import tomli_w
from pydantic import BaseModel

from tidal import run_layout
from tidal.config.inference import ADMIN_TOKEN_ENV
from tidal.config.rl import RLConfig
from tidal.errors import NO_RESTART_EXIT, UserError
from tidal.inference.disagg import empty_store, storage_of
from tidal.launcher.argv import tidal_argv, torchrun_argv
from tidal.launcher.plan import ORCHESTRATOR, TRAINER, place
from tidal.launcher.restarts import (
    Recovery,
    RestartPolicy,
    how_it_ended,
    keeps_batches,
    max_restarts,
    missing_batches,
)
from tidal.launcher.split import RoleConfigs, run_admin_token, split_config
from tidal.monitor.console import Console, clock
from tidal.monitor.events import EventLog
from tidal.monitor.metrics import MetricsTail
from tidal.monitor.progress import BackgroundPlot, StepReporter
from tidal.process import DeathWatch, ManagedProcess, ProcessEnded, stop_together, wait_healthy

if TYPE_CHECKING:
    from tidal.monitor.wandb_run import WandbRun

POLL_SECONDS = 0.5
STATUS_SECONDS = 15.0
"""How often the launcher says what it still waits for (vLLM loading, the first step)."""


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


@dataclass(frozen=True)
class ClusterNode:
    """The node a `Launcher` runs in a cluster run (`tidal node`): its index (tidal.launcher.plan), every
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
        self.orchestrator: ManagedProcess | None = None
        self.servers: dict[int, ManagedProcess] = {}
        """The vLLM servers' pids, each with the `tidal inference` child that started it."""
        self.deaths = DeathWatch()
        self.stop_signal: int | None = None
        self.started = 0.0
        """When this node started the run, as the output dir's storage stamps it (cluster runs)."""
        self.logs = self.out / "logs"
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        """Each child's first command and environment by name: what a restart starts again."""
        self.urls: dict[str, str] = {}
        """Each local replica's URL by name."""
        self.policy = RestartPolicy(max_restarts(config), config.restarts.window)
        self.events = EventLog(self.out, None if node is None else node.label)
        self.up: set[str] = set()
        """Roles that got going once (a replica: healthy; trainer, orchestrator: logged a step): a first
        process that exits with an error before that has a setup problem a restart would only repeat."""
        self.restarting: dict[str, float] = {}
        """Restarted replicas not healthy yet, by name, with the deadline (monotonic) for it."""
        self.recoveries: list[Recovery] = []
        """Failures restarted from whose recovery is not complete yet."""
        self._trained = MetricsTail(run_layout.trainer_dir(self.out) / "metrics.jsonl")
        self._produced = MetricsTail(run_layout.orchestrator_dir(self.out) / "metrics.jsonl")
        self.console = Console(config.max_steps, config.monitor.progress)
        self.reporter: StepReporter | None = None
        """On the orchestrator's node: the console's steps, the W&B run, the plot."""
        self.plot = BackgroundPlot(self.out, config.monitor.plot_interval)

    def run(self) -> int:
        if ORCHESTRATOR in self.here:
            self._check_output_dir()
        if self.node is not None:
            self.started = run_layout.mark_node(self.out, self.index, "started", self.node.run_id)
        if self.config.resume and self._hosts_trainer_rendezvous():
            # before any trainer starts (the other trainer nodes wait for this one's rendezvous): the
            # checkpoint is verified (not found broken once vLLM is up), and trainer and orchestrator must
            # not race over a killed run's leftovers
            run_layout.prepare_resume(self.out, self._say)
        on_gpu = _on_gpu()
        addresses = self.node.addresses if self.node is not None else None
        roles = split_config(self.config, on_gpu, addresses=addresses)
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
            self._stop_all()
            if kv_store is not None:  # prompt KV of the last weights: of no use to a later run
                empty_store(kv_store)
            self.plot.stop()
            if self.reporter is not None:
                self._close_reporter(self.reporter, code)
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
        self._say(f"stopped {took}")

    def _supervise(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> int:
        from tidal.inference.server import check_port_free

        # before starting anything: a server already on that port would pass the health wait below
        for index in local:
            check_port_free(roles.replicas[index].server.host, roles.replicas[index].server.port)
        logs = self.logs
        urls = roles.replica_urls
        waiting: dict[str, ManagedProcess | None] = {}
        for index in local:
            name = replica_name(index, len(roles.replicas))
            child = self._start(name, tidal_argv("inference", paths[name]), env[name])
            self.replicas.append(child)
            self.urls[name] = urls[index]
            self.up.add(name)  # healthy below, or the run stops
            waiting[urls[index]] = child
        if ORCHESTRATOR in self.here:  # the other nodes' replicas too: the orchestrator needs every one
            waiting.update({url: None for url in urls if url not in waiting})
        if local:
            what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
            self._say(f"starting {what} ({roles.inference.model.name}); logs in {logs}/")
        early = self._start_while_loading(roles, local, paths, env)
        if ORCHESTRATOR in self.here:  # while vLLM loads: W&B takes seconds to start too
            self.reporter = StepReporter(self.out, self.config.max_steps, self.console, self._open_wandb())
        self._wait_healthy(waiting)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        for replica in self.replicas:
            self._watch_servers(replica)
        if TRAINER in self.here and self.trainer is None:
            self._start_trainer(paths, env)
        self._say_started(len(urls), local, early)
        reporter = self.reporter
        marked = False
        first_step = _Reminder(STATUS_SECONDS)
        while True:
            if reporter is not None:
                self.plot.after(reporter.poll())
            self._follow_progress()
            if TRAINER not in self.up and reporter is not None and first_step.due():
                self._say(
                    f"waiting for the first step: {first_step.elapsed():.0f} s since inference came up (the "
                    f"trainer loading the model, the first rollouts); logs in {self.logs}/"
                )
            if self.stop_signal is not None:
                print(f"{self.prefix}: signal {self.stop_signal}: stopping every process", file=sys.stderr)
                return 128 + self.stop_signal
            failure = self._first_failure()
            if failure is not None:
                self._recover(failure)  # or stop the run
                continue
            self._check_restarted_replicas()
            main = [c for c in (self.trainer, self.orchestrator) if c is not None]
            if all(c.poll() == 0 for c in main):
                if reporter is not None:
                    reporter.poll()
                self._end_recoveries()
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

    def _start_while_loading(
        self, roles: RoleConfigs, local: list[int], paths: dict[str, Path], env: dict[str, dict[str, str]]
    ) -> list[ManagedProcess]:
        """Start what need not wait for vLLM, so that its start-up (imports, loading and sharding the model)
        overlaps vLLM's: the orchestrator always (it uses no GPU and waits for /health itself), the trainer
        when it shares no GPU with this node's replicas (vLLM sizes its cache from the memory free while it
        starts, so a trainer allocating on the same GPU then could make it fail or take too little)."""
        # (replica_gpus is empty on a machine without GPUs: nothing to share)
        replica_gpus = {gpu for index in local if roles.replica_gpus for gpu in roles.replica_gpus[index]}
        started: list[ManagedProcess] = []
        for role in roles_while_loading(self.here, replica_gpus, self.config.deployment.trainer_gpus):
            if role == ORCHESTRATOR:
                argv = tidal_argv("orchestrator", paths["orchestrator"])
                self.orchestrator = self._start("orchestrator", argv, env["orchestrator"])
                started.append(self.orchestrator)
            else:
                started.append(self._start_trainer(paths, env))
        return started

    def _start_trainer(self, paths: dict[str, Path], env: dict[str, dict[str, str]]) -> ManagedProcess:
        self.trainer = self._start("trainer", self._trainer_argv(paths["trainer"]), env["trainer"])
        return self.trainer

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

    def _say_started(self, num_replicas: int, local: list[int], early: list[ManagedProcess]) -> None:
        started = [role for role in (TRAINER, ORCHESTRATOR) if role in self.here]
        roles = started_roles(started, {child.name for child in early})
        if self.node is None:
            are = "are" if len(local) > 1 else "is"
            what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
            self._say(f"{what} {are} up; {roles}")
        elif started:
            self._say(
                roles + (f" ({num_replicas} inference replicas up)" if ORCHESTRATOR in self.here else "")
            )
        else:
            self._say(f"{len(local)} inference replica(s) up; serving until the run ends")

    def _main_nodes_done(self) -> bool:
        """Whether every node with the trainer or the orchestrator has finished this run."""
        assert self.node is not None
        nodes = {*self.placement.trainer_nodes, self.placement.orchestrator_node}
        return all(run_layout.node_done(self.out, n, self.node.run_id, self.started) for n in nodes)

    def _first_failure(self) -> "Failure | None":
        """What to blame, if anything failed: of the children that exited non-zero, or an inference child
        and its vLLM server that ended at all, the one that ended first (the others most likely failed on it)."""
        failed: list[Failure] = []
        for order, child in enumerate(self.children):
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

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        self.commands.setdefault(name, (argv, env))
        child = ManagedProcess(name, argv, self.logs / f"{name}{self.suffix}.log", env).start()
        self.children.append(child)
        if child.pid is not None:
            self.deaths.watch(child.pid)
        return child

    def _watch_servers(self, replica: ManagedProcess) -> None:
        """Each vLLM server runs in its own session under `tidal inference`: watch it die ourselves (the
        orchestrator fails on a dead server too, but later) and stop its group even if it is orphaned."""
        for pid in replica.adopt_descendants():
            self.servers[pid] = replica
            self.deaths.watch(pid)

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
                self._say(
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
            raise UserError(self._failure(ended.child)) from None
        if left and self.stop_signal is None:
            url, replica = next(iter(left.items()))
            what = f"{replica.name} not healthy" if replica is not None else "inference replica not healthy"
            where = f"; see {replica.log_path}" if replica is not None else " (it runs on another node)"
            raise UserError(f"{what} at {url}/health after {self.config.startup_timeout:.0f} s{where}")

    def _failure(self, child: ManagedProcess) -> str:
        tail = child.log_tail(20)
        return f"{child.name} {child.ended_how()}; last lines of {child.log_path}:\n{tail}"

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

    def _child_env(self, roles: RoleConfigs, on_gpu: bool, local: list[int]) -> dict[str, dict[str, str]]:
        """Each child's extra environment: its devices and, for the replicas and the orchestrator, the run's
        admin token (never in a file: the configs written to the output dir have none)."""
        token = run_admin_token(self.config, os.environ, shared=self.node is not None)
        return with_admin_token(self._device_env(roles, on_gpu, local), token)

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

    # ---- restarts ------------------------------------------------------------------------------------

    def _recover(self, failure: "Failure") -> None:
        """Restart the role that failed, as `[restarts]` allows, or stop the run naming it."""
        self._follow_progress()  # what was logged before the failure is not its recovery
        role = failure.child.name
        if failure.code == NO_RESTART_EXIT:
            self._stop_run(failure, "it stopped for a reason a restart would meet again")
        if self.policy.limit == 0 or (role not in self.up and (failure.code or 0) > 0):
            self._stop_run(failure, None)
        if not self.policy.allow(role, failure.when):
            self._stop_run(failure, self.policy.refusal(role))
        if role == TRAINER:
            action = self._restart_trainer(failure)
        elif role == ORCHESTRATOR:
            action = self._restart_orchestrator(failure)
        else:
            action = self._restart_replica(failure.child)
        count, limit = self.policy.count(role), self.policy.limit
        self.events.write(
            "failure", at=_wall(failure.when), role=role, cause=failure.cause, **how_it_ended(failure.code),
            pid=failure.pid or failure.child.pid, action=action, restart=count,
        )  # fmt: skip
        window = f"{self.policy.window:.0f} s"
        self._say(f"{failure.cause}; {action} (restart {count} of {limit} within {window})")
        self.recoveries.append(Recovery(role, failure.when))

    def _stop_run(self, failure: "Failure", reason: str | None) -> NoReturn:
        self.events.write(
            "failure", at=_wall(failure.when), role=failure.child.name, cause=failure.cause,
            **how_it_ended(failure.code), pid=failure.pid or failure.child.pid, action="stop",
            **({"reason": reason} if reason else {}),
        )  # fmt: skip
        self._end_recoveries()
        self._stop_all()  # first: the culprit's log then ends with what it said while stopping
        why = f" and is not restarted: {reason}" if reason else ""
        log = failure.child.log_path
        message = f"{failure.cause}{why}; last lines of {log}:\n{failure.child.log_tail(20)}"
        raise UserError(message if self.node is None else f"{self.node.label}: {message}")

    def _retire(self, child: ManagedProcess | None) -> None:
        """Stop a child that failed (or must restart with one that did), all its groups, and forget it."""
        if child is None or child not in self.children:
            return
        child.adopt_descendants()  # torchrun's workers, a vLLM server: their own sessions
        child.stop()
        self.children.remove(child)
        if child in self.replicas:
            self.replicas.remove(child)
        for pid in [pid for pid, replica in self.servers.items() if replica is child]:
            del self.servers[pid]
        self.restarting.pop(child.name, None)

    def _restart(self, name: str, *extra: str) -> ManagedProcess:
        argv, env = self.commands[name]
        return self._start(name, [*argv, *extra], env)

    def _restart_replica(self, old: ManagedProcess) -> str:
        """The replica again on its port; the orchestrator's client takes it back into rotation once it
        answers, on the latest weights."""
        self._retire(old)
        self.replicas.append(self._restart(old.name))
        self.restarting[old.name] = time.monotonic() + self.config.startup_timeout
        return f"restarting it at {self.urls[old.name]}"

    def _check_restarted_replicas(self) -> None:
        for name, deadline in list(self.restarting.items()):
            child = next(c for c in self.replicas if c.name == name)
            if not child.alive():
                continue  # a failure of its own (`_first_failure`)
            if _answers_health(self.urls[name]):
                del self.restarting[name]
                self._watch_servers(child)
                self._back(name)
            elif time.monotonic() > deadline:
                url, timeout = self.urls[name], self.config.startup_timeout
                cause = f"{name} was not healthy at {url}/health {timeout:.0f} s after its restart"
                self._stop_run(Failure(time.monotonic(), -2, child, cause, None), None)

    def _restart_trainer(self, failure: "Failure") -> str:
        """From its latest checkpoint, alone when every batch since is still on disk; else with the
        orchestrator, which makes them again from its state at that step."""
        self._retire(self.trainer)
        step = self._resume_step(failure)
        produced = max(run_layout.saved_state_steps(self.out), default=0)
        sent = [n for n, _ in run_layout.step_dirs(run_layout.rollouts_dir(self.out))]
        missing = missing_batches(step, produced, sent)
        if keeps_batches(self.config) and not missing:
            self.trainer = self._restart(TRAINER, "--resume")
            return f"restarting it from its checkpoint at step {step}"
        why = "zmq keeps no batch" if not missing else f"batch {missing[0]} is gone"
        step = self._restart_both(failure)
        return f"restarting it and the orchestrator from the checkpoint at step {step} ({why})"

    def _restart_orchestrator(self, failure: "Failure") -> str:
        """From its own newest state (the batches it sent stay); with zmq, whose batches died with it, with
        the trainer from the trainer's checkpoint."""
        self._retire(self.orchestrator)
        if keeps_batches(self.config):
            self.orchestrator = self._restart(ORCHESTRATOR, "--resume", "--resume-from", "latest")
            return "restarting it from its own state"
        step = self._restart_both(failure)
        return (
            f"restarting it and the trainer from the trainer's checkpoint at step {step} (zmq keeps no batch)"
        )

    def _resume_step(self, failure: "Failure") -> int:
        """The checkpoint a restarted trainer resumes from, verified (damaged newer ones moved aside) where
        the trainer's rendezvous is hosted; a run with checkpoints none of which is usable stops."""
        if not self._hosts_trainer_rendezvous():
            return run_layout.trainer_resume_step(self.out)
        try:
            return run_layout.verified_resume_step(self.out, self._say)
        except UserError as exc:
            self._stop_run(failure, str(exc))

    def _restart_both(self, failure: "Failure") -> int:
        """Trainer and orchestrator both from the trainer's checkpoint, as `--resume` starts them."""
        if TRAINER not in self.here or ORCHESTRATOR not in self.here:
            self._stop_run(failure, "the trainer and the orchestrator would have to restart together, and "
                           "one of them runs on another node")  # fmt: skip
        # side by side; the trainer checkpoints on SIGTERM, so the orchestrator's resume loses least
        if self.trainer is not None:
            self.trainer.adopt_descendants()
        stop_together([c for c in (self.trainer, self.orchestrator) if c is not None and c in self.children])
        self._retire(self.trainer)
        self._retire(self.orchestrator)
        try:
            step = run_layout.prepare_resume(self.out, self._say)
        except UserError as exc:
            self._stop_run(failure, str(exc))
        self.trainer = self._restart(TRAINER, "--resume")
        self.orchestrator = self._restart(ORCHESTRATOR, "--resume")
        return step

    def _say(self, line: str) -> None:
        self.console.say(f"{self.prefix}: {line}")

    def _close_reporter(self, reporter: StepReporter, code: int) -> None:
        try:
            reporter.close(code)
        except Exception as exc:  # W&B failing at the end must not hide how the run ended
            print(f"{self.prefix}: warning: closing the W&B run failed: {exc!r}", file=sys.stderr)

    def _open_wandb(self) -> "WandbRun | None":
        if not self.config.wandb.enabled:
            return None
        from tidal.monitor.wandb_run import WandbRun

        run = WandbRun(self.config.wandb, self.out, self.config.model_dump(mode="json"))
        self._say(f"W&B run {run.run_id} ({self.config.wandb.mode}) in {self.out}/wandb/")
        return run

    def _follow_progress(self) -> None:
        """Read the steps logged since the last call: which roles got going, which recoveries are done."""
        now = time.monotonic()
        trained, produced = self._trained.new_records(), self._produced.new_records()
        if trained:
            self.up.add(TRAINER)
        if produced:
            self.up.add(ORCHESTRATOR)
        for recovery in self.recoveries:
            if trained and recovery.next_step_at is None:
                recovery.next_step_at, recovery.next_step = now, trained[0]["step"]
            logged = {TRAINER: trained, ORCHESTRATOR: produced}.get(recovery.role)
            if logged and recovery.back_at is None:
                recovery.back_at = now
        self._complete_recoveries()

    def _back(self, role: str) -> None:
        for recovery in self.recoveries:
            if recovery.role == role and recovery.back_at is None:
                recovery.back_at = time.monotonic()
        self._complete_recoveries()

    def _complete_recoveries(self) -> None:
        """Report each recovery once its role is back and the trainer has trained a step since."""
        for recovery in [r for r in self.recoveries if r.back_at is not None and r.next_step_at is not None]:
            self.recoveries.remove(recovery)
            record = recovery.record()
            self.events.write("recovery", **record)
            self._say(
                f"{recovery.role} recovered: back {record['seconds_lost']:.1f} s after it "
                f"failed; step {record['next_step']} trained {record['seconds_to_next_step']:.1f} s after"
            )

    def _end_recoveries(self) -> None:
        """At the end of the run: the recoveries not complete, with what is known of them."""
        for recovery in self.recoveries:
            self.events.write("recovery", complete=False, **recovery.record())
        self.recoveries = []


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


def roles_while_loading(
    here: Collection[str], replica_gpus: set[int], trainer_gpus: Sequence[int]
) -> list[str]:
    """Of this node's roles, those that start while its vLLM replicas load: the orchestrator (no GPU) and
    the trainer unless it would share a GPU with a replica (on a machine without GPUs it shares none)."""
    early = [ORCHESTRATOR] if ORCHESTRATOR in here else []
    if TRAINER in here and replica_gpus.isdisjoint(trainer_gpus):
        early.append(TRAINER)
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


def _wall(monotonic: float) -> float:
    """time.time() of a time.monotonic() instant."""
    return time.time() - (time.monotonic() - monotonic)


def _answers_health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def kv_store_of(roles: RoleConfigs, local: list[int]) -> Path | None:
    """The shared KV store of this node's disaggregated replicas (ExampleConnector), emptied before they
    start: KV an earlier run (or the run being resumed) computed belongs to other weights."""
    store = storage_of([roles.replicas[i] for i in local])
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
        empty_store(store)
    return store


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


def _on_gpu() -> bool:
    from tidal.inference.server import vllm_flavour

    return vllm_flavour() == "cuda"


def as_run(config: RLConfig) -> RLConfig:
    """The config with the [inference], [orchestrator] and [trainer] tables each process of a local run gets
    (split_config's derived values, e.g. `inference.weights.check_finite = "auto"` resolved): what --help
    shows as defaults. Cluster runs split on their nodes; their config is returned as it is."""
    if config.deployment.type != "local":
        return config
    roles = split_config(config, _on_gpu())
    update = {"inference": roles.inference, "orchestrator": roles.orchestrator, "trainer": roles.trainer}
    return config.model_copy(update=update)


def dry_run(config: RLConfig) -> str:
    """The resolved config of every process a local `tidal rl` would start, as the TOML files it would write
    (a cluster run's: tidal.deploy.run)."""
    roles = split_config(config, _on_gpu())
    count = len(roles.replicas)
    named: list[tuple[str, BaseModel]] = [(replica_name(i, count), r) for i, r in enumerate(roles.replicas)]
    named += [("orchestrator", roles.orchestrator), ("trainer", roles.trainer)]
    parts = []
    for name, role in named:
        body = tomli_w.dumps(role.model_dump(mode="json", exclude_none=True))
        parts.append(f"# ---- {config.output_dir}/configs/{name}.toml ----\n{body}")
    return "\n".join(parts)


def already_complete(config: RLConfig) -> str | None:
    """With --resume, the line saying that the run has nothing left to do (then nothing is started, not
    even vLLM), else None. Kubernetes runs keep output_dir on a volume of their own, not read from here."""
    if not config.resume or config.deployment.type == "kubernetes":
        return None
    online = config.orchestrator.online_eval
    final_eval = online.interval is not None and online.final
    found = run_layout.finished_checkpoint(config.output_dir, config.max_steps, final_eval)
    if found is None:
        return None
    step, path = found
    return (
        f"the run in {config.output_dir} is already complete at step {step} (max_steps {config.max_steps}; "
        f"checkpoint {path}): nothing to resume (a larger --max-steps trains on)"
    )


def say_if_complete(config: RLConfig) -> bool:
    """Print the line of `already_complete` and return True when there is one."""
    complete = already_complete(config)
    if complete is not None:
        print(f"{clock()} tidal rl: {complete}", flush=True)
    return complete is not None


def main(config: RLConfig) -> int:
    """A local `tidal rl` (a cluster run is submitted by tidal.deploy.run instead)."""
    if say_if_complete(config):
        return 0
    from tidal.envs.registry import check_envs

    # a wrong name, import or argument: one line before any server starts, not a traceback after vLLM's startup
    check_envs([(f"orchestrator.{key}", spec) for key, spec in config.orchestrator.environments()])
    from tidal.models import prepare_model_files

    prepare_model_files(config.model.name, lambda line: print(f"{clock()} tidal rl: {line}", flush=True))
    start = time.perf_counter()
    launcher = Launcher(config)
    code = 1
    try:
        code = launcher.run()
    finally:
        # a failed or stopped run gets its plot too: the steps it made are what one looks at then
        plot = final_plot(config.output_dir)
        took = f"done in {time.perf_counter() - start:.0f} s" if code == 0 else "steps so far"
        if plot is not None:
            launcher.console.say(f"tidal rl: {took}; plot: {plot}")
    return code


def final_plot(output_dir: Path) -> Path | None:
    """plots/rl.png of what the run logged; None when it logged no step (or drawing failed: said why)."""
    from tidal.monitor.plot import plot_rl_run

    if not (run_layout.orchestrator_dir(output_dir) / "metrics.jsonl").exists():
        return None
    try:
        return plot_rl_run(output_dir)
    except Exception as exc:  # the plot must not hide how the run ended
        print(f"tidal rl: warning: could not draw the plot: {exc!r}", file=sys.stderr)
        return None

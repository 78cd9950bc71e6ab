"""Restarting what dies in a `tidal rl` run, within `[restarts]`: whether a failed role restarts (the budget
of tidal.launcher.restarts.RestartPolicy, and the failures a restart would only repeat), what its restart
does (a replica on its port; the trainer from its latest checkpoint, alone or with the orchestrator; the
orchestrator from its own state), and when it has recovered. A failure that is not restarted stops the run
with a one-line error naming it.
"""

import time
from typing import NoReturn

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.errors import NO_RESTART_EXIT, UserError
from tidal.launcher.children import Children, Failure
from tidal.launcher.plan import ORCHESTRATOR, TRAINER
from tidal.launcher.report import RunReport
from tidal.launcher.restarts import Recovery, RestartPolicy, keeps_batches, max_restarts, missing_batches
from tidal.monitor.metrics import MetricsTail
from tidal.process import ManagedProcess


class Restarter:
    """The restart policy of one node's children and the restarts themselves. `here`: the roles this node
    runs; `hosts_rendezvous`: whether it hosts the trainer's rendezvous (it then verifies the checkpoint a
    restarted trainer resumes from); `node_label` starts the run's error on a cluster node."""

    def __init__(
        self,
        config: RLConfig,
        children: Children,
        report: RunReport,
        here: tuple[str, ...],
        hosts_rendezvous: bool,
        node_label: str | None,
    ):
        self.config = config
        self.out = config.output_dir
        self.children = children
        self.report = report
        self.here = here
        self.hosts_rendezvous = hosts_rendezvous
        self.node_label = node_label
        self.policy = RestartPolicy(max_restarts(config), config.restarts.window)
        self.urls: dict[str, str] = {}
        """Each local replica's URL by name."""
        self.up: set[str] = set()
        """Roles that got going once (a replica: healthy; trainer, orchestrator: logged a step): a first
        process that exits with an error before that has a setup problem a restart would only repeat."""
        self.restarting: dict[str, float] = {}
        """Restarted replicas not healthy yet, by name, with the deadline (monotonic) for it."""
        self.recoveries: list[Recovery] = []
        """Failures restarted from whose recovery is not complete yet."""
        self._trained = MetricsTail(run_layout.trainer_dir(self.out) / "metrics.jsonl")
        self._produced = MetricsTail(run_layout.orchestrator_dir(self.out) / "metrics.jsonl")

    def recover(self, failure: Failure) -> None:
        """Restart the role that failed, as `[restarts]` allows, or stop the run naming it."""
        self.follow_progress()  # what was logged before the failure is not its recovery
        role = failure.child.name
        if failure.code == NO_RESTART_EXIT:
            self.stop_run(failure, "it stopped for a reason a restart would meet again")
        if self.policy.limit == 0 or (role not in self.up and (failure.code or 0) > 0):
            self.stop_run(failure, None)
        if not self.policy.allow(role, failure.when):
            self.stop_run(failure, self.policy.refusal(role))
        if role == TRAINER:
            action = self._restart_trainer(failure)
        elif role == ORCHESTRATOR:
            action = self._restart_orchestrator(failure)
        else:
            action = self._restart_replica(failure.child)
        count, limit = self.policy.count(role), self.policy.limit
        self.report.failure(failure, action, restart=count)
        window = f"{self.policy.window:.0f} s"
        self.report.say(f"{failure.cause}; {action} (restart {count} of {limit} within {window})")
        self.recoveries.append(Recovery(role, failure.when))

    def stop_run(self, failure: Failure, reason: str | None) -> NoReturn:
        """Record the failure, stop every child and raise the run's error: what failed, why it is not
        restarted, and the end of its log."""
        self.report.failure(failure, "stop", **({"reason": reason} if reason else {}))
        self.end_recoveries()
        self.children.stop_all()  # first: the culprit's log then ends with what it said while stopping
        why = f" and is not restarted: {reason}" if reason else ""
        log = failure.child.log_path
        message = f"{failure.cause}{why}; last lines of {log}:\n{failure.child.log_tail(20)}"
        raise UserError(message if self.node_label is None else f"{self.node_label}: {message}")

    def _retire(self, child: ManagedProcess | None) -> None:
        if child is not None and self.children.retire(child):
            self.restarting.pop(child.name, None)

    def _restart_replica(self, old: ManagedProcess) -> str:
        """The replica again on its port; the orchestrator's client takes it back into rotation once it
        answers, on the latest weights."""
        self._retire(old)
        self.children.replicas.append(self.children.restart(old.name))
        self.restarting[old.name] = time.monotonic() + self.config.startup_timeout
        return f"restarting it at {self.urls[old.name]}"

    def check_restarted_replicas(self) -> None:
        """Take each restarted replica that answers /health back (its servers watched, its recovery
        timed); stop the run if one is not healthy within `startup_timeout` of its restart."""
        for name, deadline in list(self.restarting.items()):
            child = next(c for c in self.children.replicas if c.name == name)
            if not child.alive():
                continue  # a failure of its own (`Children.first_failure`)
            if _answers_health(self.urls[name]):
                del self.restarting[name]
                self.children.watch_servers(child)
                self._back(name)
            elif time.monotonic() > deadline:
                url, timeout = self.urls[name], self.config.startup_timeout
                cause = f"{name} was not healthy at {url}/health {timeout:.0f} s after its restart"
                self.stop_run(Failure(time.monotonic(), -2, child, cause, None), None)

    def _restart_trainer(self, failure: Failure) -> str:
        """From its latest checkpoint, alone when every batch since is still on disk; else with the
        orchestrator, which makes them again from its state at that step."""
        self._retire(self.children.trainer)
        step = self._resume_step(failure)
        produced = max(run_layout.saved_state_steps(self.out), default=0)
        sent = [n for n, _ in run_layout.step_dirs(run_layout.rollouts_dir(self.out))]
        missing = missing_batches(step, produced, sent)
        if keeps_batches(self.config) and not missing:
            self.children.trainer = self.children.restart(TRAINER, "--resume")
            return f"restarting it from its checkpoint at step {step}"
        why = "zmq keeps no batch" if not missing else f"batch {missing[0]} is gone"
        step = self._restart_both(failure)
        return f"restarting it and the orchestrator from the checkpoint at step {step} ({why})"

    def _restart_orchestrator(self, failure: Failure) -> str:
        """From its own newest state (the batches it sent stay); with zmq, whose batches died with it, with
        the trainer from the trainer's checkpoint."""
        self._retire(self.children.orchestrator)
        if keeps_batches(self.config):
            self.children.orchestrator = self.children.restart(
                ORCHESTRATOR, "--resume", "--resume-from", "latest"
            )
            return "restarting it from its own state"
        step = self._restart_both(failure)
        return (
            f"restarting it and the trainer from the trainer's checkpoint at step {step} (zmq keeps no batch)"
        )

    def _resume_step(self, failure: Failure) -> int:
        """The checkpoint a restarted trainer resumes from, verified (damaged newer ones moved aside) where
        the trainer's rendezvous is hosted; a run with checkpoints none of which is usable stops."""
        if not self.hosts_rendezvous:
            return run_layout.trainer_resume_step(self.out)
        try:
            return run_layout.verified_resume_step(self.out, self.report.say)
        except UserError as exc:
            self.stop_run(failure, str(exc))

    def _restart_both(self, failure: Failure) -> int:
        """Trainer and orchestrator both from the trainer's checkpoint, as `--resume` starts them."""
        if TRAINER not in self.here or ORCHESTRATOR not in self.here:
            self.stop_run(failure, "the trainer and the orchestrator would have to restart together, and "
                          "one of them runs on another node")  # fmt: skip
        # side by side; the trainer checkpoints on SIGTERM, so the orchestrator's resume loses least
        self.children.stop_main()
        self._retire(self.children.trainer)
        self._retire(self.children.orchestrator)
        try:
            step = run_layout.prepare_resume(self.out, self.report.say)
        except UserError as exc:
            self.stop_run(failure, str(exc))
        self.children.trainer = self.children.restart(TRAINER, "--resume")
        self.children.orchestrator = self.children.restart(ORCHESTRATOR, "--resume")
        return step

    # ---- recoveries: from a failure to the role back and the trainer's next step -------------------

    def follow_progress(self) -> None:
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
            self.report.recovered(recovery)

    def end_recoveries(self) -> None:
        """At the end of the run: the recoveries not complete, with what is known of them."""
        for recovery in self.recoveries:
            self.report.unfinished(recovery)
        self.recoveries = []


def _answers_health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False

"""`tidal orchestrator`: for each step, wait until inference is recent enough, collect groups, ship a batch.

    wait for policy ≥ step − max_async_level → run groups (bounded in flight) → drop stale / zero-signal /
    failed groups, refill (at most max_tasks_factor × num_prompts tasks) → advantages → pack per trainer
    rank → send batch `step` → save state → log

Inference keeps serving while the trainer works on the previous batch: with max_async_level = k the
rollouts of step n may come from any policy n − k … n, which is where asynchrony buys speed.
"""

import asyncio
import functools
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal import run_layout
from tidal.config.base import ConfigProblem
from tidal.config.rl import OrchestratorConfig, check_off_policy_steps
from tidal.envs.base import Environment, Task
from tidal.envs.reward_pool import reward_workers
from tidal.errors import RunStop, UserError
from tidal.inference.client import InferenceClient
from tidal.inference.errors import InferenceError
from tidal.inference.teacher import TeacherClient, TeacherError
from tidal.monitor.events import EventLog
from tidal.monitor.metrics import MetricsLogger
from tidal.orchestrator.advantages import StalenessTracker, filter_groups
from tidal.orchestrator.batching import (
    ExpandPictures,
    drop_too_long,
    make_train_batches,
    make_train_samples,
)
from tidal.orchestrator.curriculum import Curriculum
from tidal.orchestrator.distill import DistillWeights, check_teacher, reverse_kl
from tidal.orchestrator.inflight import GroupPool, KeepRate, LaunchRule
from tidal.orchestrator.lag import LoopLagMonitor, frozen_heap, lag_metrics
from tidal.orchestrator.policy import PolicyWatcher
from tidal.orchestrator.rollouts import run_group
from tidal.orchestrator.samples import is_sample_step, pick_rollouts, sample_record
from tidal.orchestrator.stats import (
    ReplicaCounts,
    StepStats,
    mean_std,
    per_env_metrics,
    replica_metrics,
    shortfall,
)
from tidal.transport.rollouts import setup_sender
from tidal.types import Group, Rollout

logger = logging.getLogger(__name__)


def staleness_bound(config: OrchestratorConfig) -> int:
    """How many versions old a group may be when its step trains (`max_off_policy_steps`, unset
    `max_async_level`); a one-line error when it is below `max_async_level` (`tidal rl` refuses that before
    anything starts; `tidal orchestrator` alone, here)."""
    try:
        return check_off_policy_steps(config.max_off_policy_steps, config.max_async_level)
    except ConfigProblem as problem:
        raise UserError(f"{problem.key}: {problem}", exit_code=2) from None


@dataclass
class OrchestratorState:
    """Everything a resumed orchestrator needs to continue the same sequence of steps."""

    step: int = 0
    """Next batch to produce."""
    position: int = 0
    """Next task position in the environment's stream."""
    requeued: list[int] = field(default_factory=list)
    """Task positions started but not finished when a step closed; run again first (same seeds)."""
    buffer: list[dict[str, Any]] = field(default_factory=list)
    """Finished groups not used yet (Group.to_dict())."""
    staleness: dict[str, int] = field(default_factory=dict)
    curriculum: dict[str, Any] = field(default_factory=dict)
    """Curriculum.state_dict() (empty without a curriculum)."""


def build_env(config: OrchestratorConfig) -> Environment:
    """One environment, or an EnvMix over several by weight (task order seeded by the run's seed)."""
    from tidal.envs.registry import build_envs, check_pictures

    for spec in config.env:  # `tidal rl` checks them before it starts anything; `tidal orchestrator` here
        check_pictures(spec.name, config.model.name)
    return build_envs(config.env, seed=config.seed)


def setup_expand(config: OrchestratorConfig) -> ExpandPictures | None:
    """The model's processor expanding a prompt's pictures into its image tokens and arrays, when an
    environment of the run gives pictures; None for a text run (no processor loaded)."""
    from tidal.envs.registry import gives_images
    from tidal.models.vision import setup_pictures

    if not any(gives_images(spec.name) for spec in config.env):
        return None
    return setup_pictures(config.model.name, config.model.trust_remote_code)


class Orchestrator:
    """Owns the task stream, the group buffer and the batch sender; `run()` is the whole process."""

    def __init__(self, config: OrchestratorConfig):
        from tidal.inference.tokenizer import load_tokenizer

        self.config = config
        self.out = config.output_dir
        self.env = build_env(config)
        # built at the first online eval, reused, closed at the end
        self.eval_envs: dict[str, Environment] = {}
        self.tokenizer = load_tokenizer(config.model)
        self.expand_pictures = setup_expand(config)
        self.state = OrchestratorState()
        bound = staleness_bound(config)
        self.tracker = StalenessTracker(bound)
        self.state_dir = run_layout.orchestrator_states_dir(self.out)
        self.metrics = MetricsLogger(run_layout.orchestrator_dir(self.out) / "metrics.jsonl")
        self.samples = MetricsLogger(run_layout.samples_path(self.out))
        self.online_evals = MetricsLogger(run_layout.online_eval_path(self.out))
        self.lag = LoopLagMonitor()
        self.pool = GroupPool()
        b = config.batch
        self.launch_rule = LaunchRule(
            num_prompts=b.num_prompts,
            max_in_flight=config.client.max_in_flight,
            max_async_level=config.max_async_level,
            limit=math.floor(b.max_tasks_factor * b.num_prompts),
            last_step=config.max_steps - 1,
            max_off_policy_steps=bound,
        )
        self.keep_rate = KeepRate()
        self.curriculum = (
            None
            if config.curriculum is None
            else Curriculum(config.curriculum, self.env.num_tasks(), config.seed)
        )
        self.teacher, self.distill = setup_teacher(config, self.tokenizer)
        self._replicas_before: list[ReplicaCounts] | None = None

    async def run(self) -> int:
        cfg = self.config
        sender = setup_sender(cfg.transport, self.out, lambda: run_layout.trainer_checkpoint_step(self.out))
        client = InferenceClient.from_config(
            cfg.client, require_routes=cfg.routing_replay, max_async_level=cfg.max_async_level
        )
        events = EventLog(self.out)

        def worker_event(event: str, **fields: Any) -> None:
            events.write(event, role="reward_worker", **fields)

        async with client, reward_workers(cfg.reward_workers, worker_event):
            # A fresh run waits for every replica (`tidal rl` starts it while they load: a batch must not be
            # generated by the first one up alone). Resumed, possibly restarted while a replica is down (`tidal
            # rl` restarts what dies), it starts with the others and takes that one back once it answers (the
            # client's health watch, which brings it to the latest weights first).
            needed = 1 if cfg.client.recovery_timeout > 0 and cfg.resume else None
            await client.pool.wait_healthy(timeout=cfg.client.startup_timeout, count=needed)
            if (
                self.teacher is not None
            ):  # `tidal rl` starts it beside the student's servers: it may load longer
                try:
                    await self.teacher.wait_ready(cfg.client.startup_timeout)
                except TeacherError as exc:
                    raise UserError(f"orchestrator.teacher: {exc}") from None
            policy = PolicyWatcher(client, self.out)
            if cfg.resume:
                self._restore(sender)
            if cfg.resume and cfg.resume_from == "latest":
                await client.weights.reclaim()  # the orchestrator before this one may have died mid-update
            await policy.start()
            self.lag.start()
            try:
                with frozen_heap():
                    while self.state.step < cfg.max_steps:
                        await self._one_step(client, policy, sender)
                    self.pool.cancel_all()  # groups started for steps past the last
                if cfg.online_eval.interval and cfg.online_eval.final:
                    await self._final_eval(client, policy)
            finally:
                self.pool.cancel_all()
                await self.lag.stop()
                await policy.stop()
                sender.close()
                if self.teacher is not None:
                    await self.teacher.aclose()
                for env in (self.env, *self.eval_envs.values()):
                    close = getattr(env, "aclose", None)  # verifiers environments serve an endpoint
                    if close is not None:
                        await close()
        self.metrics.close()
        return 0

    async def _one_step(self, client: InferenceClient, policy: PolicyWatcher, sender: Any) -> None:
        cfg, step = self.config, self.state.step
        start = time.perf_counter()
        waited = await policy.wait_for(step - cfg.max_async_level)
        evaluated: dict[str, float] = {}
        if cfg.online_eval.interval and step % cfg.online_eval.interval == 0:
            evaluated = await self._online_eval(client, step, policy.version)
        groups, advantages, stats = await self._collect(client, policy, step)
        b = cfg.batch
        make = functools.partial(
            make_train_samples, groups, advantages, expand_pictures=self.expand_pictures, distill=self.distill
        )
        made = time.perf_counter()
        try:
            # a picture costs its processor ~0.1-0.2 s (resize, tiles): off the loop, whose rollouts go on
            samples = await asyncio.to_thread(make) if self.expand_pictures is not None else make()
        except ValueError as exc:  # an environment's pictures that its prompt's placeholders do not match
            raise UserError(f"orchestrator.env: {exc}") from None
        made = time.perf_counter() - made
        samples, too_long = drop_too_long(samples, b.seq_len)
        self._warn_too_long(step, too_long, len(samples))
        try:
            batches = make_train_batches(
                step, samples, b.num_trainer_ranks, b.seq_len, b.micro_batch_size, self.tokenizer.pad_token_id,
                cp=b.cp, pad_multiple=b.pad_multiple,
            )  # fmt: skip
        except ValueError as exc:
            raise UserError(f"orchestrator.batch.seq_len: {exc}") from None
        elapsed = time.perf_counter() - start
        replicas = self._replica_metrics(client, elapsed)
        # log, save the state past this step, send: whenever this process dies, a restart from its newest
        # state neither sends a batch twice nor skips one, and logs each step once (`_restore`)
        extra = {**evaluated, **replicas, "rollouts/dropped_too_long": float(too_long)}
        if self.expand_pictures is not None:  # the processor's share of the step (tidal.models.vision)
            extra["time/pictures"] = made
        if self.distill is not None:  # KL(student ‖ teacher) per token, sampled on what this step trains
            kl = reverse_kl([r for g in groups for r in g.rollouts if not r.failed])
            extra.update(
                {
                    "distill/reverse_kl": kl.per_token,
                    "distill/tokens": float(kl.tokens),
                    "distill/reverse_kl_per_sequence": kl.per_sequence,
                }
            )
        self._log(step, groups, stats, policy, elapsed, waited, extra)
        self._keep_samples(step, groups)
        self.state.step = step + 1
        self._save_state()
        sender.send(step, batches)

    async def _collect(
        self, client: InferenceClient, policy: PolicyWatcher, step: int
    ) -> tuple[list[Group], list[list[float]], StepStats]:
        """`num_prompts` fresh groups with signal, taken in the order they started (`tidal.orchestrator.
        inflight`: groups for later steps start while the policy allows), refilling drops. Groups still
        running or waiting at the end go on into the next step if it may train them.

        At most `max_tasks_factor × num_prompts` new tasks for the step itself: then it trains on fewer
        groups (warned), or, with none, stops the run with the reason (every rollout failing, rewards that
        never differ).
        """
        cfg, stats, rule, pool = self.config, StepStats(), self.launch_rule, self.pool
        num_prompts = cfg.batch.num_prompts
        kept: list[Group] = []
        advantages: list[list[float]] = []
        pool.add_finished([Group.from_dict(g) for g in self.state.buffer])  # a restored state's
        self.state.buffer = []
        stats.num_carried_in = len(pool)
        drawn = 0
        while len(kept) < num_prompts:
            group = pool.pop_ready()
            if group is not None:
                stats.num_groups_run += 1
                self._accept([group], step, kept, advantages, stats)
                continue
            version = policy.version
            waiting = len(pool) - pool.num_running
            room = rule.room(step, version, len(kept), pool.num_running, drawn, waiting, self.keep_rate.value)
            if room == 0 and not pool.num_running:
                break  # the step's refill budget is spent and nothing runs
            for _ in range(room):
                position, task = self._next_task()
                pool.start(position, version, self._run(client, task, position))
                drawn += 1
            if pool.num_running:
                await pool.wait(functools.partial(policy.newer_than, version))
        self.keep_rate.observe(len(kept), stats.num_groups_run)
        # the groups the next step may not train: run again later, same seeds
        cancelled = pool.carry_into(step + 1, rule)
        stats.num_cancelled = len(cancelled)
        self.state.requeued += cancelled
        self._check_enough(step, len(kept), stats)
        return kept, advantages, stats

    def _replica_metrics(self, client: InferenceClient, seconds: float) -> dict[str, float]:
        now = [
            ReplicaCounts(
                s.requests, s.completion_tokens, s.in_flight, s.version, s.healthy, s.weight_updates
            )
            for s in client.pool.servers.values()
        ]
        metrics = replica_metrics(now, self._replicas_before, seconds)
        self._replicas_before = now
        return metrics

    def _check_enough(self, step: int, num_kept: int, stats: StepStats) -> None:
        """Stop with the reason when a step found no group to train on; warn when it found fewer than asked."""
        num_prompts = self.config.batch.num_prompts
        if num_kept >= num_prompts:
            return
        reason = shortfall(step, num_kept, num_prompts, stats)
        if num_kept == 0:
            raise RunStop(reason)
        print(f"orchestrator: {reason}; training on them", flush=True)

    async def _final_eval(self, client: InferenceClient, policy: PolicyWatcher) -> None:
        """The online eval of the policy the last step trained (version max_steps, once inference serves it);
        it has no step of its own to be logged with, so it goes to online_eval.jsonl only."""
        steps = self.config.max_steps
        print(f"orchestrator: waiting for the weights of step {steps} for the final eval", flush=True)
        await policy.wait_for(steps)
        await self._online_eval(client, steps, policy.version, final=True)

    async def _online_eval(
        self, client: InferenceClient, step: int, version: int, final: bool = False
    ) -> dict[str, float]:
        """The same evaluation as `tidal eval`, on the policy inference serves now; logged as eval/<env>/...

        An eval environment that fails is logged and left out; training goes on."""
        from tidal.config.eval import EvalConfig
        from tidal.envs.registry import build_env as build_one
        from tidal.eval.runner import EvalResults, evaluate_envs, write_rollouts

        spec = self.config.online_eval
        assert spec.env is not None and spec.sampling is not None  # OrchestratorConfig fills the defaults
        eval_config = EvalConfig(
            env=spec.env, num_tasks=spec.num_tasks, k=spec.k, sampling=spec.sampling, seed=self.config.seed
        )
        for env_spec in eval_config.env:
            if env_spec.display_name not in self.eval_envs:
                self.eval_envs[env_spec.display_name] = build_one(env_spec)
        envs = [(s, self.eval_envs[s.display_name]) for s in eval_config.env]
        results = EvalResults()
        await evaluate_envs(client.generation, self.tokenizer, envs, eval_config, results)
        self._keep_eval(step, version, final, results.reports)
        if keeps_rollouts(spec.save_rollouts, step, final):
            write_rollouts(run_layout.online_eval_rollouts_path(self.out, step, final), results.records)
        metrics: dict[str, float] = {"eval/policy_version": version}
        for name, report in results.reports.items():
            for key, value in report.items():
                if isinstance(value, int | float):
                    metrics[f"eval/{name}/{key}"] = value
                elif isinstance(value, dict) and "mean" in value:  # avg@k / pass@k with their interval
                    metrics[f"eval/{name}/{key}"] = value["mean"]
                    metrics[f"eval/{name}/{key}_ci_low"] = value["ci_low"]
                    metrics[f"eval/{name}/{key}_ci_high"] = value["ci_high"]
        print(
            f"orchestrator {'final' if final else 'online'} eval at step {step}: "
            + ", ".join(
                f"{k} {v:.3f}"
                for k, v in metrics.items()
                if ("avg@" in k or "pass@" in k) and "_ci_" not in k
            ),
            flush=True,
        )
        return metrics

    def _keep_eval(self, step: int, version: int, final: bool, reports: dict[str, Any]) -> None:
        """One line of online_eval.jsonl: the reports as `tidal eval` writes them (intervals, failures)."""
        self.online_evals.log(step, {"policy_version": version, "final": final, "envs": reports})

    def _accept(
        self,
        groups: list[Group],
        step: int,
        kept: list[Group],
        advantages: list[list[float]],
        stats: StepStats,
    ) -> None:
        stats.record(groups)
        split = self.tracker.keep_fresh(groups, step)
        stats.num_stale_rollouts += split.num_stale_rollouts
        # distillation alone needs no reward signal: the teacher gives every token its own advantage
        distill_alone = self.distill is not None and self.distill.reward_weight == 0
        result = filter_groups(
            split.fresh,
            policy="keep" if self.config.batch.zero_signal == "keep" or distill_alone else "drop",
            kind=self.config.batch.advantage,
        )
        stats.num_zero_signal += result.num_zero_signal
        stats.num_failed_groups += result.num_failed_groups
        stats.num_failed_rollouts += result.num_failed_rollouts
        kept.extend(result.groups)
        advantages.extend(result.advantages)

    async def _run(self, client: InferenceClient, task: Task, position: int) -> Group:
        group = await self._run_group(client, task, position)
        if self.teacher is not None:
            await score_with_teacher(self.teacher, group)
        if self.curriculum is not None:  # every group that ends, kept or dropped later, informs it
            self.curriculum.observe(position, [r.reward for r in group.rollouts if not r.failed])
        return group

    async def _run_group(self, client: InferenceClient, task: Task, position: int) -> Group:
        cfg = self.config
        try:
            return await run_group(
                client.generation,
                self.env,
                self.tokenizer,
                task,
                position,
                cfg.batch.group_size,
                cfg.sampling,
                cfg.seed,
                cfg.rollout_timeout,
            )
        except InferenceError as exc:
            raise UserError(f"inference failed for task {task.task_id}: {exc}") from exc

    def _next_task(self) -> tuple[int, Task]:
        if self.state.requeued:
            position = self.state.requeued.pop(0)
        else:
            position = self.state.position
            self.state.position += 1
        if self.curriculum is not None:
            return position, self.env.task(self.curriculum.pick(position))
        return position, self.env.task(position % self.env.num_tasks())

    def _warn_too_long(self, step: int, dropped: int, kept: int) -> None:
        """A rollout longer than a packed row cannot be trained on: warn, and stop only when none is left."""
        if not dropped:
            return
        seq_len = self.config.batch.seq_len
        advice = "raise orchestrator.batch.seq_len or lower orchestrator.sampling.max_tokens"
        if not kept:
            raise RunStop(
                f"step {step}: every rollout is longer than orchestrator.batch.seq_len ({seq_len} tokens, "
                f"prompt + completion): nothing to train on; {advice}"
            )
        print(
            f"orchestrator: warning: step {step}: dropped {dropped} rollout(s) longer than "
            f"orchestrator.batch.seq_len ({seq_len} tokens, prompt + completion); {advice}",
            flush=True,
        )

    def _log(
        self,
        step: int,
        groups: list[Group],
        stats: StepStats,
        policy: PolicyWatcher,
        elapsed: float,
        waited: float,
        extra: dict[str, float],
    ) -> None:
        metrics = step_metrics(
            step, groups, stats, policy, elapsed, waited, self.tracker.num_dropped_rollouts
        )
        metrics.update(per_env_metrics(stats, groups))
        metrics.update(extra)  # online eval, per-replica counts
        metrics.update(lag_metrics(self.lag.take()))
        metrics.update(self.lag.take_gc())
        if self.curriculum is not None:
            metrics.update(self.curriculum.take_metrics())
        self.metrics.log(step, metrics)
        warn_if_loop_held(step, metrics, self.config.loop_lag_warn)
        if not self.config.log.prints(step, self.config.max_steps):
            return
        print(
            f"orchestrator step {step} | reward {metrics['reward/mean']:.3f} | off-policy ≤{metrics['off_policy/max']}"
            f" | {metrics['tokens_per_s']:.0f} tok/s | {elapsed:.2f} s",
            flush=True,
        )

    def _keep_samples(self, step: int, groups: list[Group]) -> None:
        """Some of the step's rollouts as text, every `samples.interval` steps."""
        spec = self.config.samples
        if not is_sample_step(step, spec.interval):
            return

        def decode(ids: list[int]) -> str:
            return str(self.tokenizer.decode(ids, skip_special_tokens=False))

        for rollout in pick_rollouts(groups, spec.num):
            self.samples.log(step, sample_record(rollout, decode))

    # ---- state -------------------------------------------------------------------------------------

    def _save_state(self) -> None:
        self.state.staleness = self.tracker.state_dict()
        if self.curriculum is not None:
            self.state.curriculum = self.curriculum.state_dict()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"step_{self.state.step}.json"
        tmp = path.with_suffix(".tmp")
        # groups started for later steps: the ended ones are kept, the running ones start again on resume
        saved = {
            **self.state.__dict__,
            "requeued": self.pool.positions() + self.state.requeued,
            "buffer": [g.to_dict() for g in self.pool.finished_groups()],
        }
        tmp.write_text(json.dumps(saved))
        tmp.rename(path)
        self._prune_states()

    def _prune_states(self) -> None:
        """Keep the states a resumed trainer may need: from its oldest checkpoint on (a damaged newer one
        makes the resume fall back)."""
        trainer_step = run_layout.oldest_trainer_checkpoint_step(self.out)
        for found in self.state_dir.glob("step_*.json"):
            if int(found.stem.split("_")[1]) < trainer_step:
                found.unlink(missing_ok=True)

    def _restore(self, sender: Any) -> None:
        """Continue from the trainer's latest checkpoint (the batches after it are produced again), or with
        `resume_from = "latest"` from this process's own newest state."""
        if self.config.resume_from == "latest":
            self._restore_latest()
            return
        step = run_layout.trainer_resume_step(self.out)  # the one `tidal rl` verified: the trainer's too
        path = self.state_dir / f"step_{step}.json"
        if step > 0 and not path.exists():
            raise UserError(f"--resume: trainer checkpoint is at step {step} but {path} is missing")
        if path.exists():
            self._load_state(path)
        self.metrics.truncate_after(step - 1)
        self.samples.truncate_after(step - 1)
        self.online_evals.truncate_after(step - 1)
        sender.discard_from(step)  # the transport's own copies (zmq keeps batches in memory)
        run_layout.discard_after_checkpoint(self.out)  # `tidal rl` did it already, before starting anyone
        print(f"orchestrator: resuming at step {step}", flush=True)

    def _load_state(self, path: Path) -> None:
        self.state = OrchestratorState(**json.loads(path.read_text()))
        self.tracker.load_state_dict(self.state.staleness)
        if self.curriculum is not None and self.state.curriculum:  # a run given a curriculum only now: fresh
            self.curriculum.load_state_dict(self.state.curriculum)

    def _restore_latest(self) -> None:
        """Continue after the last batch sent, every batch before it kept (the trainer may be reading them)."""
        saved = run_layout.saved_state_steps(self.out)
        sent = {n for n, _ in run_layout.step_dirs(run_layout.rollouts_dir(self.out))}
        step = own_resume_step(saved, sent)
        path = self.state_dir / f"step_{step}.json"
        if step > 0 and not path.exists():
            raise UserError(f"resume_from = 'latest': the state to continue from, {path}, is missing")
        if step > 0:
            self._load_state(path)
        self.metrics.truncate_after(step - 1)
        self.samples.truncate_after(step - 1)
        self.online_evals.truncate_after(step - 1)
        print(f"orchestrator: restarted at step {step} from its own state", flush=True)


def setup_teacher(
    config: OrchestratorConfig, tokenizer: Any
) -> tuple[TeacherClient | None, DistillWeights | None]:
    """The teacher's client and the distillation weights (None, None without `[orchestrator.teacher]`); a
    teacher whose tokenizer is not the student's is a one-line UserError."""
    spec = config.teacher
    if spec is None:
        return None, None
    check_teacher(
        config.env, tokenizer, spec.model, config.model.trust_remote_code, "orchestrator.teacher.model"
    )
    return TeacherClient(spec), DistillWeights(kl_weight=spec.kl_weight, reward_weight=spec.reward_weight)


async def score_with_teacher(teacher: TeacherClient, group: Group) -> None:
    """Set each finished rollout's `teacher_logprobs`; where the teacher cannot score them, the rollouts fail
    (`error/TeacherError`, logged) and the run goes on."""
    scored = [r for r in group.rollouts if not r.failed]
    try:
        found = await teacher.logprobs(
            [r.prompt_ids + r.completion_ids for r in scored], [len(r.prompt_ids) for r in scored]
        )
    except TeacherError as exc:
        logger.warning("teacher: the rollouts of %s were not scored: %s", group.task_id, exc)
        for rollout in scored:
            rollout.failed = True
            rollout.metrics["error/TeacherError"] = 1.0
        return
    for rollout, logprobs in zip(scored, found, strict=True):
        rollout.teacher_logprobs = logprobs


def step_metrics(
    step: int,
    groups: list[Group],
    stats: StepStats,
    policy: PolicyWatcher,
    elapsed: float,
    waited: float,
    dropped_stale_total: int,
) -> dict[str, Any]:
    """A step's own metrics: rewards, off-policy lag, what happened to its rollouts, its times and weight
    updates (per-environment, online-eval and event-loop metrics are added by the caller)."""
    rollouts = [r for g in groups for r in g.rollouts]  # the batch: failed rollouts are removed already
    # The headline reward is every finished rollout's this step: the batch alone leaves out the zero-signal
    # groups it dropped, so its mean moves with how many groups qualify, not with the policy.
    sampled = [reward for rewards in stats.env_rewards.values() for reward in rewards]
    reward_mean, reward_std = mean_std(sampled)
    lags = [step - r.policy_version for r in rollouts]
    num_tokens = sum(len(r.completion_ids) for r in rollouts)
    return {
        # generation spent on every group the step took, dropped ones included, per group it trains on
        "rollouts/tokens_generated": stats.num_completion_tokens,
        "rollouts/tokens_per_kept_group": stats.num_completion_tokens / max(1, len(groups)),
        "reward/mean": reward_mean,
        "reward/std": reward_std,
        "reward/batch_mean": mean_std([r.reward for r in rollouts])[0],
        "off_policy/max": max(lags, default=0),
        "off_policy/mean": mean_std(lags)[0],
        "policy_version": policy.version,
        "rollouts/dropped_stale": stats.num_stale_rollouts,
        "rollouts/dropped_stale_total": dropped_stale_total,
        "rollouts/zero_signal_groups": stats.num_zero_signal,
        "rollouts/failed": stats.num_failed_rollouts,
        "rollouts/failed_frac": stats.failed_frac,
        "rollouts/groups_kept": len(groups),
        "rollouts/failed_groups": stats.num_failed_groups,
        "rollouts/groups_run": stats.num_groups_run,
        "rollouts/groups_carried_in": stats.num_carried_in,
        "rollouts/groups_cancelled": stats.num_cancelled,
        "completion_len/mean": num_tokens / max(1, len(rollouts)),
        "tokens_per_s": num_tokens / max(elapsed, 1e-9),
        "time/step": elapsed,
        "time/wait_for_policy": waited,
        "time/weight_updates_total": policy.update_seconds,
        "weights/updates_total": policy.num_updates,
        # inside the servers (tidal's one-request update route): what the round trips above cost beyond it
        **{f"time/weight_update_{k}_total": v for k, v in policy.phase_seconds.items()},
        "rollouts/replica_switches": stats.num_replica_switches,
        **tool_metrics(rollouts),
    }


def tool_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """The batch's mean of every `tools/...` metric its rollouts carry (calls, errors, seconds: ToolEnv), over
    the rollouts that carry it (a mixed run's other environments call no tools)."""
    keys = sorted({key for r in rollouts for key in r.metrics if key.startswith("tools/")})
    return {key: mean_std([r.metrics[key] for r in rollouts if key in r.metrics])[0] for key in keys}


def keeps_rollouts(which: str, step: int, final: bool) -> bool:
    """Whether the online eval at `step` (`final`: the one after the last step) writes its rollouts."""
    return which == "all" or (which == "first_and_final" and (final or step == 0))


def warn_if_loop_held(step: int, metrics: dict[str, Any], limit: float) -> None:
    """One line when the event loop was held longer than `orchestrator.loop_lag_warn` at once in the step."""
    worst = metrics.get("event_loop/lag_max_s", 0.0)
    if worst > limit:
        print(
            f"orchestrator: warning: step {step}: the event loop was held {worst:.2f} s at once "
            f"(p99 {metrics['event_loop/lag_p99_s']:.3f} s, longest GC pause "
            f"{metrics['event_loop/gc_max_s']:.2f} s); every request in flight waited",
            flush=True,
        )


def own_resume_step(saved: list[int], sent: set[int]) -> int:
    """The step a restart from the orchestrator's own state continues at: its newest saved state, unless
    the batch that state follows was never sent (the state is saved first): then the one before (pure).
    `saved`: steps of the states on disk; `sent`: steps of the batches on disk (filesystem transport)."""
    newest = max(saved, default=0)
    if newest > 0 and newest - 1 not in sent:
        return newest - 1
    return newest


def main(config: OrchestratorConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request drowns the log
    if not config.resume and (run_layout.orchestrator_dir(config.output_dir) / "metrics.jsonl").exists():
        raise UserError(
            f"output_dir {config.output_dir} already holds a run; pass --resume or choose another --output-dir"
        )
    return asyncio.run(Orchestrator(config).run())

"""What one step's collection did, as metrics and as the reason a step got too few groups (pure logic).

Reward means, everywhere, are over the rollouts that produced a reward: a failed rollout has none (its 0.0
is a placeholder), so it is left out of every mean and counted in `failed_frac` beside it instead.
"""

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.types import Group


@dataclass
class StepStats:
    """Counts over every group run for one step (kept or dropped), for the metrics and for a stop's reason."""

    num_zero_signal: int = 0
    num_failed_groups: int = 0
    num_failed_rollouts: int = 0
    num_stale_rollouts: int = 0
    num_groups_run: int = 0
    num_carried_in: int = 0
    """Groups still running from earlier steps when this step began collecting (started ahead for it)."""
    num_cancelled: int = 0
    """Groups still running at the step's end that the next step may not train (their policy too old):
    cancelled, their tasks run again later. Started ahead for refills that were not needed."""
    num_completion_tokens: int = 0
    """Completion tokens of every rollout of the groups taken (dropped ones too): the generation spent."""
    num_replica_switches: int = 0
    """Multi-turn rollouts whose turns more than one inference replica served (prefix cache lost)."""
    env_rewards: dict[str, list[float]] = field(default_factory=dict)
    """Rewards of every finished rollout per environment, kept or dropped (zero-signal groups included)."""
    env_rollouts: Counter[str] = field(default_factory=Counter)
    env_failed: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    """Failed rollouts by error name (`error/<Name>` in their metrics)."""

    def record(self, groups: Sequence[Group]) -> None:
        for group in groups:
            finished = [r.reward for r in group.rollouts if not r.failed]
            self.env_rewards.setdefault(group.env, []).extend(finished)
            self.env_rollouts[group.env] += len(group.rollouts)
            self.env_failed[group.env] += len(group.rollouts) - len(finished)
            self.num_completion_tokens += sum(len(r.completion_ids) for r in group.rollouts)
            for r in group.rollouts:
                self.num_replica_switches += r.metrics.get("inference/replicas", 1.0) > 1
                if r.failed:
                    self.errors.update(
                        key.removeprefix("error/") for key in r.metrics if key.startswith("error/")
                    )

    @property
    def num_rollouts(self) -> int:
        return sum(self.env_rollouts.values())

    @property
    def failed_frac(self) -> float:
        """Share of the rollouts run this step that failed (stale groups included, like `num_rollouts`)."""
        return sum(self.env_failed.values()) / max(1, self.num_rollouts)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of the finite values (0, 0 when there are none).

    Plain float arithmetic: `statistics` converts to exact fractions and raises on NaN or inf.
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 0.0
    mean = math.fsum(finite) / len(finite)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / len(finite))


def per_env_metrics(stats: StepStats, kept: Sequence[Group]) -> dict[str, float]:
    """Per environment (`env/<name>/...`): mean reward and failures over every rollout run this step (a mixed
    run drops zero-signal groups per env, so the kept batch alone would hide an env that earns nothing), and
    the groups that made it into the batch."""
    out: dict[str, float] = {}
    for name, num in stats.env_rollouts.items():
        out[f"env/{name}/reward/mean"] = mean_std(stats.env_rewards.get(name, []))[0]
        out[f"env/{name}/rollouts"] = float(num)
        out[f"env/{name}/failed"] = float(stats.env_failed[name])
        out[f"env/{name}/rollouts/failed_frac"] = stats.env_failed[name] / max(1, num)
        out[f"env/{name}/kept_groups"] = float(sum(g.env == name for g in kept))
    return out


def failure_causes(stats: StepStats) -> str:
    """`TemplateMismatch × 60, TimeoutError × 4`, most frequent first."""
    return ", ".join(f"{name} × {count}" for name, count in stats.errors.most_common()) or "no error recorded"


def shortfall(step: int, num_kept: int, num_prompts: int, stats: StepStats) -> str:
    """One line on why step `step` has `num_kept` < `num_prompts` groups after drawing all it may."""
    if stats.num_rollouts and stats.failed_frac == 1.0:
        return f"all {stats.num_rollouts} rollouts of step {step} failed: {failure_causes(stats)}"
    found = f"only {num_kept} of {num_prompts} groups" if num_kept else "no group"
    failed = f"{stats.num_failed_rollouts} of {stats.num_rollouts} rollouts failed"
    if stats.num_failed_rollouts:
        failed += f" ({failure_causes(stats)})"
    return (
        f"step {step}: {found} with a learning signal after {stats.num_groups_run} groups run "
        f"({stats.num_zero_signal} zero-signal, {stats.num_failed_groups} failed, "
        f"{stats.num_stale_rollouts} stale rollouts; {failed}); "
        "the limit is orchestrator.batch.max_tasks_factor × num_prompts tasks per step"
    )


@dataclass(frozen=True)
class ReplicaCounts:
    """One inference replica's running totals as the client counted them, and what it serves now."""

    requests: int
    completion_tokens: int
    in_flight: int
    version: int
    healthy: bool
    weight_updates: int = 0


def replica_metrics(
    now: Sequence[ReplicaCounts], before: Sequence[ReplicaCounts] | None, seconds: float
) -> dict[str, float]:
    """Per replica (numbered in `orchestrator.client.urls` order) over one step: requests answered, tokens
    generated per second, requests in flight and the weight version at the step's end, whether it is in
    rotation, and the weight updates it loaded so far. `before` is the previous step's counts (None: the client's totals start at zero)."""
    metrics: dict[str, float] = {}
    for index, counts in enumerate(now):
        previous = before[index] if before is not None else None
        requests = counts.requests - (previous.requests if previous else 0)
        tokens = counts.completion_tokens - (previous.completion_tokens if previous else 0)
        prefix = f"inference/replica_{index}"
        metrics[f"{prefix}/requests"] = requests
        metrics[f"{prefix}/tokens_per_s"] = tokens / max(seconds, 1e-9)
        metrics[f"{prefix}/in_flight"] = counts.in_flight
        metrics[f"{prefix}/version"] = counts.version
        metrics[f"{prefix}/healthy"] = float(counts.healthy)
        metrics[f"{prefix}/weight_updates"] = counts.weight_updates
    return metrics

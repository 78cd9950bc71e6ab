"""Pure evaluation metrics: avg@k, the unbiased pass@k estimator, and confidence intervals over tasks."""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct.

    The unbiased estimator 1 − C(n−c, k) / C(n, k) (Chen et al., 2021), computed as a product so large n
    does not overflow.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass(frozen=True)
class Estimate:
    """A mean over tasks with a two-sided confidence interval."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci_low": self.low, "ci_high": self.high}


def mean_with_ci(values: Sequence[float], confidence: float = 0.95) -> Estimate:
    """Mean and normal-approximation interval (mean ± z·s/√n, sample std), clipped to the values' range.

    A NaN or infinite value gives that mean with a NaN interval: reported, never a crash (`statistics.stdev`
    raises on them).
    """
    if not values:
        return Estimate(math.nan, math.nan, math.nan)
    if not all(math.isfinite(v) for v in values):
        return Estimate(sum(values) / len(values), math.nan, math.nan)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(mean, mean, mean)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = z * std / math.sqrt(len(values))
    return Estimate(mean, max(min(values), mean - half), min(max(values), mean + half))


def k_values(k: int) -> list[int]:
    """The k's pass@k is reported for: 1, powers of two below k, and k itself."""
    out = [1]
    while out[-1] * 2 < k:
        out.append(out[-1] * 2)
    return sorted({*out, k})


def summarize(
    rewards_per_task: Sequence[Sequence[float]], threshold: float = 1.0, confidence: float = 0.95
) -> dict[str, dict[str, float]]:
    """avg@k and pass@j (j in `k_values(k)`) over tasks, each with its interval; k = samples per task."""
    if not rewards_per_task:
        return {}
    k = min(len(r) for r in rewards_per_task)
    if k == 0:
        raise ValueError("every task needs at least one sample")
    out = {f"avg@{k}": mean_with_ci([statistics.fmean(r) for r in rewards_per_task], confidence).to_dict()}
    for j in k_values(k):
        per_task = [pass_at_k(len(r), sum(x >= threshold for x in r), j) for r in rewards_per_task]
        out[f"pass@{j}"] = mean_with_ci(per_task, confidence).to_dict()
    return out

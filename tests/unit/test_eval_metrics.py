"""Eval metrics (pass@k, intervals, summaries), the eval config and its report/markdown helpers."""

import asyncio
import json
import math
from itertools import combinations

import pytest

from tidal.config.eval import EvalConfig
from tidal.envs.base import SingleTurnEnv, Task
from tidal.envs.reverse_text import ReverseTextEnv
from tidal.eval.metrics import k_values, mean_with_ci, pass_at_k, summarize
from tidal.eval.runner import (
    EvalResults,
    RolloutRecord,
    env_report,
    evaluate_env,
    evaluate_envs,
    markdown_table,
    write_outputs,
)
from tidal.models.tiny import build_tokenizer


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (8, 1, 4), (8, 7, 2), (6, 0, 6)]
)
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k))


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # large n: no overflow
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_mean_with_ci():
    est = mean_with_ci([0.0, 1.0] * 50, confidence=0.95)
    assert est.mean == 0.5
    assert est.high - est.mean == pytest.approx(1.96 * math.sqrt(0.5 * 0.5 * 100 / 99) / 10, rel=1e-3)
    assert mean_with_ci([1.0] * 5).low == mean_with_ci([1.0] * 5).high == 1.0
    assert mean_with_ci([0.3]).mean == 0.3
    assert math.isnan(mean_with_ci([]).mean)
    tight, wide = mean_with_ci([0, 1] * 50, 0.5), mean_with_ci([0, 1] * 50, 0.99)
    assert wide.high > tight.high
    assert mean_with_ci([0.0, 0.0, 1.0]).low >= 0.0  # clipped to the values' range


def test_summarize_reports_avg_and_pass_at_powers_of_two():
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0, 1.0, 0.5, 1.0]]
    out = summarize(rewards, threshold=1.0)
    assert set(out) == {"avg@4", "pass@1", "pass@2", "pass@4"}
    assert out["avg@4"]["mean"] == pytest.approx((0.25 + 0 + 0.875) / 3)
    assert out["pass@1"]["mean"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert out["pass@4"]["mean"] == pytest.approx(2 / 3)
    assert summarize([[0.5]], threshold=0.5)["pass@1"]["mean"] == 1.0


def test_env_report_counts_failures_as_zero_reward():
    config = EvalConfig(k=2)
    records = [
        RolloutRecord("e", "e/0", 0, 0, reward=1.0, metrics={"num_turns": 1.0}),
        RolloutRecord("e", "e/0", 0, 1, failed=True, error="TimeoutError: "),
        RolloutRecord("e", "e/1", 1, 0, reward=0.0, metrics={"num_turns": 3.0}),
        RolloutRecord("e", "e/1", 1, 1, reward=1.0, metrics={"num_turns": 1.0}),
    ]
    report = env_report(records, config)
    assert report["num_failed"] == 1 and report["num_tasks"] == 2
    assert report["avg@2"]["mean"] == pytest.approx(0.5)
    assert report["pass@2"]["mean"] == 1.0
    assert report["metrics"]["num_turns"] == pytest.approx(5 / 3)
    assert report["failures"] == {"TimeoutError": 1} and report["first_failure"] == "TimeoutError: "
    table = markdown_table("m", {"e": report}, 0.95)
    assert "| env | tasks | k | failed | avg@2 | pass@1 | pass@2 |" in table
    assert "| e | 2 | 2 | 1 | 0.500 [" in table
    assert "Failed rollouts of e: TimeoutError × 1; the first: TimeoutError: " in table
    clean = env_report([records[0], records[2]], config)
    assert "failures" not in clean and "Failed rollouts" not in markdown_table("m", {"e": clean}, 0.95)


def test_eval_config_checks():
    with pytest.raises(ValueError, match="greedy"):
        EvalConfig(k=4, sampling={"temperature": 0})
    with pytest.raises(ValueError, match="appear twice"):
        EvalConfig(env=[{"name": "math"}, {"name": "math"}])
    config = EvalConfig(model={"name": "some/model"})
    assert config.inference_config().model.name == "some/model"


def test_mean_with_ci_of_non_finite_values_is_nan_not_a_crash():
    estimate = mean_with_ci([math.nan, 1.0, 0.0])
    assert math.isnan(estimate.mean) and math.isnan(estimate.low) and math.isnan(estimate.high)
    with_inf = mean_with_ci([math.inf, 1.0])
    assert with_inf.mean == math.inf and math.isnan(with_inf.low) and math.isnan(with_inf.high)


class NanEnv(SingleTurnEnv):
    """Two tasks whose only reward function returns NaN."""

    name = "nan_env"

    def __init__(self):
        super().__init__(rewards=[(self.nan_reward, 1.0)])

    def num_tasks(self) -> int:
        return 2

    def task(self, index: int) -> Task:
        return Task(task_id=f"nan_env/{index}", messages=[{"role": "user", "content": "hi"}])

    def nan_reward(self, task: Task, episode) -> float:
        return math.nan


class BrokenEnv(NanEnv):
    name = "broken"

    def task(self, index: int) -> Task:
        raise RuntimeError("dataset row missing")


def test_a_nan_reward_fails_those_rollouts_and_the_env_report_is_written(tmp_path):
    from tests.unit.test_orchestrator_loop import FakeClient

    config = EvalConfig(output_dir=tmp_path, k=2, env=[{"name": "reverse_text", "label": "nan_env"}])
    tokenizer = build_tokenizer()
    records = asyncio.run(evaluate_env(FakeClient(), tokenizer, NanEnv(), config.env[0], config))
    assert all(
        r.failed and r.error.startswith("NonFiniteReward: reward function 'nan_reward'") for r in records
    )
    report = env_report(records, config)
    assert report["num_failed"] == 4 and report["avg@2"]["mean"] == 0.0


def test_one_failing_env_does_not_lose_the_other_envs_results(tmp_path):
    from tests.unit.test_orchestrator_loop import FakeClient

    config = EvalConfig(
        output_dir=tmp_path,
        num_tasks=3,
        env=[{"name": "reverse_text"}, {"name": "reverse_text", "label": "broken"}],
    )
    envs = [(config.env[0], ReverseTextEnv(num_examples=3)), (config.env[1], BrokenEnv())]
    results = EvalResults()
    asyncio.run(evaluate_envs(FakeClient(), build_tokenizer(), envs, config, results))
    write_outputs(config, results, seconds=1.0)
    written = json.loads((tmp_path / "eval.json").read_text())["envs"]
    assert written["reverse_text"]["num_rollouts"] == 3 and "avg@1" in written["reverse_text"]
    assert written["broken"]["error"] == "RuntimeError: dataset row missing"
    assert "| broken | error: RuntimeError: dataset row missing |" in (tmp_path / "eval.md").read_text()

"""benchmarks/distill_vs_rl.py's equal generation budget: the generation that trained each eval's policy, and
the eval at which a run has spent its budget (in tokens, or in samples counting the groups it dropped)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports
from distill_vs_rl import at_budget, scored_evals, spent_before  # noqa: E402


def rows() -> list[dict[str, float]]:
    # step 0 ran 6 groups (2 dropped), step 1 ran 4, step 2 ran 8; tokens follow the completions' lengths
    return [
        {"step": 0, "rollouts/tokens_generated": 100, "rollouts/groups_run": 6},
        {"step": 1, "rollouts/tokens_generated": 50, "rollouts/groups_run": 4},
        {"step": 2, "rollouts/tokens_generated": 400, "rollouts/groups_run": 8},
    ]


def eval_at(step: int, mean: float) -> dict:
    report = {"avg@1": {"mean": mean, "ci_low": mean - 0.1, "ci_high": mean + 0.1}, "num_tasks": 10}
    return {"step": step, "final": False, "envs": {"math": report, "broken": {"error": "x"}}}


def test_an_evals_policy_is_charged_with_the_batches_of_the_steps_before_it() -> None:
    assert spent_before(rows(), 0, "tokens", 8) == 0
    assert spent_before(rows(), 2, "tokens", 8) == 150
    assert spent_before(rows(), 3, "samples", 8) == 8 * 18  # every group run, kept or not
    scored = scored_evals(rows(), [eval_at(2, 0.5), eval_at(0, 0.1)], "samples", 4)
    assert [(e["step"], e["samples"], e["heldout"]["mean"]) for e in scored] == [
        (0, 0.0, 0.1),
        (2, 40.0, 0.5),
    ]


@pytest.mark.parametrize(
    ("budget", "unit", "step", "before"),
    [(150, "tokens", 2, 0), (151, "tokens", 3, 2), (40, "samples", 2, 0), (0, "tokens", 0, None)],
)
def test_the_budget_closes_at_the_first_eval_that_reaches_it(
    budget: float, unit: str, step: int, before: int | None
) -> None:
    evals = [eval_at(0, 0.1), eval_at(2, 0.3), eval_at(3, 0.6)]
    found = at_budget(scored_evals(rows(), evals, unit, 4), budget, unit)
    assert found is not None and found["at"]["step"] == step
    assert (found["before"] or {}).get("step") == before


def test_a_budget_no_eval_has_reached_is_not_closed() -> None:
    evals = [eval_at(0, 0.1), eval_at(2, 0.3)]
    assert at_budget(scored_evals(rows(), evals, "tokens", 8), 10_000, "tokens") is None
    assert at_budget(scored_evals(rows(), [], "tokens", 8), 0, "tokens") is None

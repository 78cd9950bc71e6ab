"""A stop that a restart would meet again ends `tidal rl` at once: no restarts spent on it.

The untrained tiny model never answers a math task right, so every group of its rollouts scores 0 alike: the
orchestrator finds no learning signal in the tasks it may draw for step 0 and exits with code 3
(tidal.errors.RunStop). The launcher must stop the run there, naming why, rather than restart the
orchestrator into the same state three times.
"""

import pytest

from tests.conftest import run_tidal
from tests.integration.conftest import free_port
from tidal.errors import NO_RESTART_EXIT
from tidal.monitor.events import read_events

pytestmark = pytest.mark.slow


def test_a_step_without_learning_signal_stops_the_run_without_restarts(tmp_path):
    out = tmp_path / "rl"
    result = run_tidal(
        "rl", "@", "configs/ci/rl_tiny.toml", "--output-dir", str(out),
        "--orchestrator.env", '[{name = "math", kwargs = {num_examples = 64}}]',
        "--orchestrator.batch.num-prompts", "2", "--orchestrator.batch.group-size", "2",
        "--orchestrator.batch.max-tasks-factor", "1", "--orchestrator.batch.zero-signal", "drop",
        "--inference.server.port", str(free_port()),
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()
    assert any(
        f"orchestrator exited with code {NO_RESTART_EXIT} and is not restarted" in line for line in last
    ), result.stderr[-3000:]
    assert "no group with a learning signal" in result.stderr
    assert "Traceback" not in result.stderr
    orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
    assert "restarted at step" not in orchestrator_log
    failures = [e for e in read_events(out) if e["event"] == "failure"]
    assert [(e["role"], e["action"], e.get("exit_code")) for e in failures] == [
        ("orchestrator", "stop", NO_RESTART_EXIT)
    ], failures

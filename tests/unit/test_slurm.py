"""Slurm without Slurm: the batch script of the examples (`tidal rl` and `tidal sft`), the `[slurm]` config, the
node agent's reading of scontrol output and of its flags (the real cluster runs in
tests/integration/test_slurm.py)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_tidal
from tidal import run_layout
from tidal.config.loader import load_config
from tidal.config.node import NodeConfig, SFTNodeConfig
from tidal.config.rl import RLConfig
from tidal.config.sft import SFTConfig
from tidal.deploy import slurm
from tidal.deploy.node import parse_hostnames, parse_node_addrs, resolve_node
from tidal.errors import UserError
from tidal.launcher.rl import trainer_argv
from tidal.trainer.signals import StopSignal

MATH = str(REPO / "examples/math/rl.toml")
TWO = str(REPO / "examples/cluster/slurm_2node.toml")
THIRTY_TWO = str(REPO / "examples/cluster/slurm_32node.toml")
WORKDIR = Path("/shared/work")


def config(*files: str, **overrides: object) -> RLConfig:
    return load_config(RLConfig, list(files), list(overrides.items()))


def script(cfg: RLConfig | SFTConfig) -> str:
    return slurm.render(cfg, WORKDIR)[2]


def sbatch_lines(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_the_two_node_example_asks_for_two_whole_gpu_nodes_and_starts_one_agent_on_each():
    text = script(config(MATH, TWO))
    options = sbatch_lines(text)
    assert options[:5] == [
        "--job-name=tidal-rl", "--nodes=2", "--ntasks-per-node=1", "--exclusive", "--gpus-per-node=8",
    ]  # fmt: skip
    out = WORKDIR / "outputs/math/rl"
    for option in ("--partition=gpu", "--time=12:00:00", f"--output={out}/slurm/tidal-rl-%j.log",
                   "--open-mode=append", "--requeue", f"--chdir={WORKDIR}"):  # fmt: skip
        assert option in options
    # setup runs in the batch shell and again on every node, before tidal
    assert text.count("source .venv/bin/activate") == 2
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun == [
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL "
        'bash -c "$node_script" tidal-node $resume'
    ]
    assert f"-m tidal node @ {out}/slurm/rl.toml" in text
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume="--resume"; fi' in text
    assert "export TIDAL_ADMIN_TOKEN" in text


def test_the_32_node_example_script(tmp_path):
    text = script(config(MATH, THIRTY_TWO))
    options = sbatch_lines(text)
    for option in ("--nodes=32", "--gpus-per-node=8", "--account=my-project", "--time=2-00:00:00", "--mem=0"):
        assert option in options
    assert "#   inference: nodes 0-23, 8 vLLM replica(s) each" in text
    assert "#   trainer:   nodes 24-31, 8 rank(s) each" in text
    assert "#   orchestrator: node 24" in text
    assert text.count("module load cuda/12.4") == 2
    assert "exec python -m tidal node @ " in text
    assert "srun --nodes=32 --ntasks=32 " in text
    if shutil.which("bash"):
        path = tmp_path / "job.sbatch"
        path.write_text(text)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_dry_run_prints_the_32_node_batch_script_and_submits_nothing(tmp_path):
    result = run_tidal("rl", "@", MATH, "@", THIRTY_TWO, "--output-dir", str(tmp_path / "out"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=32" in result.stdout and "srun --nodes=32" in result.stdout
    assert f"# ---- {tmp_path / 'out'}/slurm/rl.toml ----" in result.stdout
    assert not (tmp_path / "out").exists()


def test_options_that_change_the_script():
    cfg = config(
        MATH, TWO,
        **{"slurm.requeue": False, "slurm.gpus_per_node": 0, "slurm.extra_sbatch": ["#SBATCH --qos=high"],
           "slurm.python": "/opt/py 3/bin/python", "slurm.srun_args": ["--mpi=none"], "slurm.exclusive": False},
    )  # fmt: skip
    text = script(cfg)
    options = sbatch_lines(text)
    assert "--no-requeue" in options and "--requeue" not in options
    assert "--qos=high" in options and "--exclusive" not in options
    assert not any(o.startswith("--gpus-per-node") for o in options)
    assert "exec '/opt/py 3/bin/python' -m tidal node" in text
    assert "--kill-on-bad-exit=1 --export=ALL --mpi=none bash" in text


def test_the_job_config_round_trips_through_tidal_node(tmp_path):
    cfg = config(MATH, TWO, output_dir="relative/run")
    job, files, _ = slurm.render(cfg, tmp_path)
    assert job.output_dir == tmp_path / "relative/run"
    path = tmp_path / "rl.toml"
    path.write_text(slurm.config_toml(job))
    node = load_config(NodeConfig, [str(path)], [("node_index", 1), ("addresses", "10.0.0.1,10.0.0.2")])
    assert node.addresses == ["10.0.0.1", "10.0.0.2"] and node.node_index == 1
    assert node.model_dump(exclude={"node_index", "addresses", "run_id"}) == job.model_dump()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"slurm.partition": "gpu"}, "slurm"),  # a [slurm] table on a local run would be ignored
        ({"deployment.type": "slurm", "slurm.extra_sbatch": ["qos=high"]}, "slurm.extra_sbatch"),
        ({"deployment.type": "slurm", "slurm.setup": ["a\nb"]}, "slurm.setup"),
        ({"deployment.type": "slurm", "slurm.job_name": "my job"}, "slurm.job_name"),
    ],
)
def test_slurm_config_errors_name_the_key(overrides, key):
    with pytest.raises(UserError, match=rf": {key}: "):
        config(MATH, **overrides)


def test_a_deployment_that_cannot_be_split_fails_at_render_not_on_the_nodes():
    cfg = config(MATH, TWO, **{"deployment.inference_gpus": [0, 1]})
    with pytest.raises(UserError, match="deployment.inference_gpus"):
        script(cfg)


SHOW_NODES = """\
NodeName=gpu-a17 Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 Gres=gpu:8 NodeAddr=10.1.0.17 NodeHostName=gpu-a17 Port=6818
NodeName=gpu-a18 Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 Gres=gpu:8 NodeAddr=gpu-a18-ib NodeHostName=gpu-a18 Port=6818
"""


def fake_scontrol(args):
    return {("show", "hostnames"): "gpu-a17\ngpu-a18\n", ("-o", "show"): SHOW_NODES}[tuple(args[:2])]


def test_scontrol_output_parsing():
    assert parse_hostnames("n1\nn2\n\n") == ["n1", "n2"]
    assert parse_node_addrs(SHOW_NODES) == {"gpu-a17": "10.1.0.17", "gpu-a18": "gpu-a18-ib"}


def node_config(**overrides: object) -> NodeConfig:
    return load_config(NodeConfig, [MATH, TWO], list(overrides.items()))


def test_the_node_learns_its_index_and_every_address_from_slurm():
    env = {
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "2",
    }
    node = resolve_node(node_config(), env, fake_scontrol, resolve={"gpu-a18-ib": "10.2.0.18"}.__getitem__)
    assert (node.index, node.name, node.addresses) == (1, "gpu-a18", ("10.1.0.17", "10.2.0.18"))
    assert node.run_id == "slurm-77-2" and node.label == "node 1 (gpu-a18)"


def test_a_node_address_that_does_not_resolve_is_one_error_naming_the_node():
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu-a[17-18]"}

    def nowhere(name: str) -> str:
        raise OSError(name)

    with pytest.raises(UserError, match="node gpu-a18: its NodeAddr 'gpu-a18-ib' does not resolve"):
        resolve_node(node_config(), env, fake_scontrol, resolve=nowhere)


def test_explicit_flags_win_over_slurm_and_are_checked():
    node = resolve_node(node_config(node_index=0, addresses="pod-0.svc,pod-1.svc", run_id="k8s-1"), {})
    assert node.addresses == ("pod-0.svc", "pod-1.svc") and node.run_id == "k8s-1" and node.index == 0
    with pytest.raises(UserError, match="deployment needs 2 nodes .* the job has 3"):
        resolve_node(node_config(node_index=0, addresses="a,b,c"), {})
    with pytest.raises(UserError, match="node_index: 2 is not below"):
        resolve_node(node_config(node_index=2, addresses="a,b"), {})
    with pytest.raises(UserError, match="SLURM_NODEID is not set"):
        resolve_node(node_config(), {})


def test_done_markers_of_an_earlier_run_do_not_count(tmp_path):
    started = run_layout.mark_node(tmp_path, 0, "started", "slurm-5-1")
    assert not run_layout.node_done(tmp_path, 1, "slurm-5-1", started)
    run_layout.mark_node(tmp_path, 1, "done", "slurm-5-0")  # the run before the requeue
    assert not run_layout.node_done(tmp_path, 1, "slurm-5-1", started)
    run_layout.mark_node(tmp_path, 1, "done", "slurm-5-1")
    assert run_layout.node_done(tmp_path, 1, "slurm-5-1", started)
    # same run id (pods restarted with --resume), but the marker predates this node's start
    old = run_layout.node_marker(tmp_path, 1, "done")
    os.utime(old, (started - 60, started - 60))
    assert not run_layout.node_done(tmp_path, 1, "slurm-5-1", started)


def test_trainer_nodes_pass_their_own_address_and_which_hosts_the_rendezvous():
    argv = trainer_argv(Path("t.toml"), 8, num_nodes=2, rendezvous="10.0.0.3:29400", run_id="j",
                        local_addr="10.0.0.4", is_host=False)  # fmt: skip
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.4"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=0"


def test_a_repeated_sigterm_does_not_kill_the_trainer_before_its_checkpoint():
    """Under Slurm every process of the job gets SIGTERM, and torchrun and the launcher forward theirs."""
    stop = StopSignal()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.exit_code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_second_ctrl_c_still_kills_at_once():
    code = (
        "import os, signal, time\n"
        "from tidal.trainer.signals import StopSignal\n"
        "StopSignal().install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGINT


SFT_RUN = str(REPO / "examples/reverse_text/sft_one_gpu.toml")
SFT_TWO = str(REPO / "examples/cluster/slurm_sft_2node.toml")


def sft_config(*files: str, **overrides: object) -> SFTConfig:
    return load_config(SFTConfig, list(files), list(overrides.items()))


def test_the_sft_example_asks_for_two_gpu_nodes_and_starts_tidal_sft_node_on_each(tmp_path):
    text = script(sft_config(SFT_RUN, SFT_TWO))
    options = sbatch_lines(text)
    out = WORKDIR / "outputs/reverse_text/sft_one_gpu"
    assert options[:5] == [
        "--job-name=tidal-sft", "--nodes=2", "--ntasks-per-node=1", "--exclusive", "--gpus-per-node=8",
    ]  # fmt: skip
    for option in (
        "--partition=gpu",
        "--time=04:00:00",
        f"--output={out}/slurm/tidal-sft-%j.log",
        "--requeue",
    ):
        assert option in options
    assert "# `tidal sft` on Slurm, rendered from the run config " + f"{out}/slurm/sft.toml" in text
    assert "#   torchrun with 8 rank(s) each, c10d rendezvous on node 0 at port 29400" in text
    assert f'-m tidal sft-node @ {out}/slurm/sft.toml "$@"' in text
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL " in text
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume="--resume"; fi' in text
    assert "TIDAL_ADMIN_TOKEN" not in text and "export PYTHONUNBUFFERED=1" in text  # no inference, no token
    assert text.count("source .venv/bin/activate") == 2
    if shutil.which("bash"):
        path = tmp_path / "job.sbatch"
        path.write_text(text)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_the_sft_job_config_round_trips_through_tidal_sft_node(tmp_path):
    cfg = sft_config(SFT_RUN, SFT_TWO, output_dir="relative/run")
    job, files, _ = slurm.render(cfg, tmp_path)
    assert files.config == tmp_path / "relative/run/slurm/sft.toml"
    path = tmp_path / "sft.toml"
    path.write_text(slurm.config_toml(job))
    node = load_config(SFTNodeConfig, [str(path)], [("node_index", 1), ("addresses", "10.0.0.1,10.0.0.2")])
    assert node.model_dump(exclude={"node_index", "addresses", "run_id"}) == job.model_dump()


def test_sft_dry_run_prints_the_batch_script_and_submits_nothing(tmp_path):
    out = tmp_path / "out"
    result = run_tidal("sft", "@", SFT_RUN, "@", SFT_TWO, "--output-dir", str(out), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"# ---- {out}/slurm/tidal-sft.sbatch ----\n#!/bin/bash\n")
    assert f"# ---- {out}/slurm/sft.toml ----" in result.stdout and "#SBATCH --nodes=2" in result.stdout
    assert not out.exists()


def test_an_sft_job_with_fewer_gpus_than_ranks_fails_at_render():
    with pytest.raises(UserError, match=r"deployment.trainer_gpus: lists 2 GPU\(s\) for 8 trainer rank"):
        script(sft_config(SFT_RUN, SFT_TWO, **{"deployment.trainer_gpus": [0, 1]}))
    script(sft_config(SFT_RUN, SFT_TWO, **{"deployment.trainer_gpus": [0, 1], "slurm.gpus_per_node": 0}))


def test_sft_submit_refuses_an_output_dir_with_a_run_unless_resumed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="already holds a run; pass --resume"):
        slurm.submit(sft_config(SFT_RUN, SFT_TWO, output_dir=str(out)))
    assert not (out / "slurm").exists()

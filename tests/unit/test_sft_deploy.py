"""`tidal sft` under `[deployment]`: the schema's one-line errors, the torchrun it starts on this machine and on
each cluster node (argv, environment, the config its ranks load), and its supervision of that torchrun
(signals passed on, exit codes passed through, nothing left running) with a stand-in torchrun. The real
runs are in tests/integration/test_sft.py and test_slurm.py."""

import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, run_tidal
from tidal.config.loader import load_config
from tidal.config.node import SFTNodeConfig
from tidal.config.sft import SFTConfig
from tidal.deploy.node import resolve_node
from tidal.errors import UserError
from tidal.launcher import sft as launcher
from tidal.launcher.plan import ClusterNode

SFT = str(REPO / "configs/ci/sft_tiny.toml")
EXAMPLE_SFT = str(REPO / "examples/reverse_text/sft_one_gpu.toml")
SLURM_SFT = str(REPO / "examples/cluster/slurm_sft_2node.toml")


def sft(*files: str, **overrides: object) -> SFTConfig:
    return load_config(SFTConfig, [SFT, *files], list(overrides.items()))


def one_line_error(**overrides: object) -> str:
    with pytest.raises(UserError) as info:
        sft(**overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_an_inference_key_in_an_sft_deployment_is_one_line_saying_sft_runs_no_inference():
    for key in (
        "num_inference_nodes",
        "num_replicas",
        "inference_gpus",
        "orchestrator_node",
        "inference_cpus",
    ):
        message = one_line_error(**{f"deployment.{key}": 1})
        assert f"command line: deployment.{key}: unknown key: `tidal sft` runs no inference" in message
        assert "did you mean" not in message  # a spelling hint would point at a trainer key
    assert "kubernetes.inference: unknown key: `tidal sft` runs trainer pods only" in one_line_error(
        **{"deployment.type": "kubernetes", "kubernetes.inference": {"cpu": "2"}}
    )


def test_the_cli_prints_the_inference_key_error_as_one_line_and_exits_2(tmp_path):
    over = tmp_path / "over.toml"
    over.write_text("[deployment]\nnum_inference_nodes = 1\n")
    result = run_tidal("sft", "@", SFT, "@", str(over), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tidal sft: error: {over}: deployment.num_inference_nodes: unknown key: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"deployment.num_trainer_nodes": 2}, "deployment.num_trainer_nodes"),  # local is one machine
        ({"slurm.partition": "gpu"}, "slurm"),  # a [slurm] table of a local run would be ignored
        ({"deployment.type": "slurm", "kubernetes.image": "i"}, "kubernetes"),
        ({"deployment.type": "kubernetes"}, "kubernetes.image"),
        ({"num_threads": 2, "deployment.trainer_threads": 1}, "deployment.trainer_threads"),
    ],
)
def test_deployment_errors_name_the_key(overrides, key):
    assert f": {key}: " in one_line_error(**overrides)


def test_several_ranks_on_gpus_need_a_gpu_each():
    config = sft(**{"deployment.num_trainer_ranks": 4, "deployment.trainer_gpus": [0, 1]})
    with pytest.raises(UserError, match=r"deployment.trainer_gpus: lists 2 GPU\(s\) for 4 trainer rank\(s\)"):
        config.deployment.check_trainer_gpus()


def test_threads_per_rank_come_from_either_key_or_the_cores_divided_among_the_ranks():
    two = {"deployment.num_trainer_ranks": 2}
    assert launcher.threads_per_rank(sft(**two), num_cpus=16) == 8
    assert launcher.threads_per_rank(sft(**two, **{"deployment.trainer_threads": 3}), num_cpus=16) == 3
    assert launcher.threads_per_rank(sft(**two, num_threads=5), num_cpus=16) == 5
    assert sft(**{"deployment.trainer_threads": 3}).cpu_threads() == 3  # what each rank sets


def test_the_local_torchrun_its_environment_and_the_config_its_ranks_load(tmp_path):
    config = sft(output_dir=str(tmp_path / "out"), **{"deployment.num_trainer_ranks": 2})
    cpu = launcher.rank_env(config, on_gpu=False)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and int(cpu["OMP_NUM_THREADS"]) >= 1
    gpu = launcher.rank_env(
        sft(**{"deployment.num_trainer_ranks": 2, "deployment.trainer_gpus": [2, 5]}), True
    )
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,5" and "OMP_NUM_THREADS" not in gpu

    text = launcher.dry_run(config)
    first, rest = text.split("\n", 1)
    path = tmp_path / "out" / "configs" / "sft.toml"
    assert first == (
        f"# tidal sft starts: {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m tidal sft @ {path}"
    )
    loaded = SFTConfig.model_validate(tomllib.loads(rest))
    assert loaded == config
    launcher.check_world_size(loaded, {"WORLD_SIZE": "2"})


def test_a_rank_refuses_a_torchrun_of_another_size_than_the_deployment_says():
    config = sft(**{"deployment.num_trainer_ranks": 2})
    with pytest.raises(
        UserError, match=r"1 node\(s\) × 2 rank\(s\) = 2 trainer ranks, but this torchrun runs 4"
    ):
        launcher.check_world_size(config, {"WORLD_SIZE": "4", "RANK": "0"})
    launcher.check_world_size(sft(), {"WORLD_SIZE": "4", "RANK": "0"})  # a torchrun started by hand decides


def test_a_local_run_with_several_ranks_refuses_an_output_dir_with_a_run_before_starting_anything(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    result = run_tidal("sft", "@", SFT, "--output-dir", str(out), "--deployment.num-trainer-ranks", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"tidal sft: error: {out} already holds a run; pass --resume to continue it or choose another --output-dir"
    )
    assert not (out / "configs").exists()


def test_each_cluster_node_runs_torchrun_joined_at_the_first_nodes_address(tmp_path, monkeypatch):
    config = load_config(
        SFTNodeConfig,
        [EXAMPLE_SFT, SLURM_SFT],
        [("output_dir", str(tmp_path / "run")), ("resume", True), ("device", "cpu")],
    )
    node = ClusterNode(index=1, addresses=("10.0.0.1", "10.0.0.2"), name="gpu-b2", run_id="slurm-7-0")
    started = []
    monkeypatch.setattr(
        launcher,
        "supervise",
        lambda argv, env, prefix: started.append((argv, env, prefix)) or launcher.Ended(0),
    )
    assert launcher.run_node(config, node) == 0
    [(argv, env, prefix)] = started
    path = tmp_path / "run" / "configs" / "sft_node1.toml"
    assert argv[1:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "10.0.0.1:29400", "--rdzv-id", "slurm-7-0", "--local-addr", "10.0.0.2", "--rdzv-conf", "is_host=0",
        "--nproc-per-node", "8", "-m", "tidal", "sft", "@", str(path),
    ]  # fmt: skip
    assert prefix == "tidal node 1 (gpu-b2)" and env["OMP_NUM_THREADS"]
    # the ranks load the job's config with this node's --resume, without the agent's own flags
    ranks = load_config(SFTConfig, [str(path)], [])
    assert ranks.resume and ranks.deployment.type == "slurm" and ranks.deployment.num_trainer_nodes == 2
    assert ranks.model_dump() == config.model_dump(exclude={"node_index", "addresses", "run_id"})
    launcher.check_world_size(ranks, {"WORLD_SIZE": "16"})


def fake_scontrol(args):
    return {
        ("show", "hostnames"): "gpu-b1\ngpu-b2\n",
        (
            "-o",
            "show",
        ): "NodeName=gpu-b1 NodeAddr=10.0.0.1 Port=6818\nNodeName=gpu-b2 NodeAddr=10.0.0.2 Port=6818\n",
    }[tuple(args[:2])]


def test_an_sft_node_learns_its_index_and_the_addresses_from_slurm():
    config = load_config(SFTNodeConfig, [EXAMPLE_SFT, SLURM_SFT], [])
    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu-b[1-2]", "SLURM_JOB_ID": "7"}
    node = resolve_node(config, env, fake_scontrol)
    assert (node.index, node.name, node.addresses, node.run_id) == (
        1,
        "gpu-b2",
        ("10.0.0.1", "10.0.0.2"),
        "slurm-7-0",
    )
    with pytest.raises(UserError, match=r"deployment needs 2 nodes \(2 trainer\), the job has 3"):
        resolve_node(load_config(SFTNodeConfig, [EXAMPLE_SFT, SLURM_SFT], [("addresses", "a,b,c")]), env)


def test_sft_node_refuses_a_local_run():
    result = run_tidal("sft-node", "@", SFT)
    assert result.returncode == 1
    assert '`tidal sft-node` runs one node of a cluster run; "local" runs use `tidal sft`' in result.stderr


# A stand-in torchrun: starts one "rank" in a session of its own (as torchrun does), which on SIGTERM writes
# a checkpoint marker and exits 143; torchrun passes SIGTERM on and exits 1 (torchrun's own code then).
FAKE_TORCHRUN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    rank = '''
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    def stop(signum, frame):
        time.sleep(0.3)  # "the checkpoint"
        (out / "checkpointed").write_text(str(signum))
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    (out / "rank.pid").write_text(str(os.getpid()))
    time.sleep(60)
    '''
    child = subprocess.Popen([sys.executable, "-c", rank, str(out)], start_new_session=True)
    stopping = []
    def stop(signum, frame):
        child.send_signal(signal.SIGTERM)
        stopping.append(signum)
    signal.signal(signal.SIGTERM, stop)
    if len(sys.argv) > 2:  # end soon, leaving the rank behind
        time.sleep(float(sys.argv[2]))
        sys.exit(0)
    while child.poll() is None:
        time.sleep(0.05)
    sys.exit(1 if stopping else child.returncode)
    """
)


def supervisor(tmp_path: Path, *fake_args: str) -> subprocess.Popen[str]:
    """A process that supervises the stand-in torchrun as `tidal sft` does, printing how it ended."""
    fake = tmp_path / "torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    code = (
        "import sys\n"
        "from tidal.launcher.sft import supervise\n"
        f"ended = supervise([sys.executable, {str(fake)!r}, {str(tmp_path)!r}, *{list(fake_args)!r}], {{}}, 'test')\n"
        "print(ended.code, ended.signal, flush=True)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_file(path: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_reaches_the_ranks_as_sigterm_and_nothing_is_left(tmp_path, sig):
    process = supervisor(tmp_path)
    wait_for_file(tmp_path / "rank.pid", process)
    time.sleep(0.7)  # the supervisor has seen the rank (it looks every POLL_SECONDS)
    process.send_signal(sig)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.split() == [str(128 + sig), str(int(sig))]
    assert f"test: signal {int(sig)}: stopping the ranks" in err
    assert (tmp_path / "checkpointed").read_text() == str(int(signal.SIGTERM))
    assert not alive(int((tmp_path / "rank.pid").read_text()))


def test_ranks_a_torchrun_left_behind_are_stopped_and_its_exit_code_passes_through(tmp_path):
    process = supervisor(tmp_path, "1.5")
    out, err = process.communicate(timeout=60)
    assert out.split() == ["0", "None"], err
    assert not alive(int((tmp_path / "rank.pid").read_text()))
    assert launcher.supervise([sys.executable, "-c", "raise SystemExit(3)"], {}, "test") == launcher.Ended(3)


def test_a_failing_node_is_a_user_error_naming_the_node(tmp_path, monkeypatch):
    config = load_config(SFTNodeConfig, [SFT], [("output_dir", str(tmp_path)), ("deployment.type", "slurm"),
                                               ("deployment.num_trainer_nodes", 2), ("device", "cpu")])  # fmt: skip
    monkeypatch.setattr(
        launcher, "torchrun_argv", lambda *a, **k: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    node = ClusterNode(index=1, addresses=("10.0.0.1", "10.0.0.2"), name="n2", run_id="r")
    with pytest.raises(
        UserError, match=r"^node 1 \(n2\): trainer \(torchrun, config \S+sft_node1.toml\) exited with code 3$"
    ):
        launcher.run_node(config, node)

"""Pure plumbing of `tidal rl`: config split, rollout transports (filesystem and ZMQ), run layout."""

import threading
from pathlib import Path

import pytest

from tests.conftest import REPO
from tidal import run_layout
from tidal.config.loader import load_config
from tidal.config.rl import (
    HELDOUT_SEED_OFFSET,
    FilesystemTransport,
    OrchestratorConfig,
    RLConfig,
    ZMQTransport,
)
from tidal.config.sft import SFTConfig
from tidal.errors import UserError
from tidal.launcher.split import run_admin_token, split_config
from tidal.transport.rollouts import FilesystemReceiver, FilesystemSender, ZMQReceiver, ZMQSender
from tidal.types import MicroBatch, TrainBatch


def tiny_batch(step: int, rank: int) -> TrainBatch:
    micro = MicroBatch(
        input_ids=[[1, 2, 3]], position_ids=[[0, 1, 2]], target_ids=[[2, 3, 0]], loss_mask=[[0, 1, 0]],
        inference_logprobs=[[0.0, -0.5, 0.0]], advantages=[[0.0, 0.25 * (rank + 1), 0.0]], sample_ids=[[0, 0, 0]],
        num_samples=1,
    )  # fmt: skip
    return TrainBatch(step=step, micro_batches=[micro], num_loss_tokens_global=2, num_samples_global=2)


def test_split_copies_shared_keys_and_pins_cpu_threads(tmp_path):
    rl = RLConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "max_steps": 7,
            "seed": 3,
            "max_async_level": 2,
            "model": {"name": "some/model"},
            "deployment": {"num_trainer_ranks": 2},
            "inference": {"server": {"port": 9001}},
            "orchestrator": {"sampling": {"temperature": 0.7}},
            "transport": {"type": "zmq", "port": 6000},
        }
    )
    roles = split_config(rl, on_gpu=False, num_cpus=8)
    assert roles.orchestrator.max_steps == roles.trainer.max_steps == 7
    assert roles.orchestrator.max_async_level == 2 and roles.orchestrator.seed == roles.trainer.seed == 3
    assert roles.inference.model.name == roles.trainer.model.name == "some/model"
    assert roles.orchestrator.client.urls == ["http://127.0.0.1:9001"]
    assert roles.orchestrator.batch.num_trainer_ranks == 2
    assert roles.trainer.temperature == 0.7
    assert isinstance(roles.trainer.transport, ZMQTransport) and roles.trainer.transport.port == 6000
    assert roles.inference.cpu.omp_threads_bind == "0-3" and roles.trainer.num_threads == 2
    two_cores = split_config(rl, on_gpu=False, num_cpus=2)
    assert two_cores.inference.cpu.omp_threads_bind == "0" and two_cores.trainer.num_threads == 1


def test_split_gives_the_orchestrator_the_trainers_cp_and_rl_checks_it_against_the_ranks(tmp_path):
    base = {
        "output_dir": str(tmp_path),
        "model": {"name": "some/model"},
        "deployment": {"num_trainer_ranks": 4},
    }
    rl = RLConfig.model_validate({**base, "trainer": {"perf": {"cp": 2}}})
    assert split_config(rl, on_gpu=False, num_cpus=8).orchestrator.batch.cp == 2
    with pytest.raises(ValueError, match="do not divide the 4 trainer rank"):
        RLConfig.model_validate({**base, "trainer": {"perf": {"cp": 3}}})
    with pytest.raises(ValueError, match="do not divide the 3 trainer rank"):
        OrchestratorConfig.model_validate(
            {"output_dir": str(tmp_path), "model": {"name": "m"}, "batch": {"num_trainer_ranks": 3, "cp": 2}}
        )


def test_filesystem_transport_is_atomic_per_step_and_prunes(tmp_path):
    sender = FilesystemSender(tmp_path, FilesystemTransport(keep_last=2))
    receivers = [
        FilesystemReceiver(tmp_path, FilesystemTransport(poll_interval=0.01), rank) for rank in range(2)
    ]
    for step in range(4):
        sender.send(step, [tiny_batch(step, 0), tiny_batch(step, 1)])
    assert [s for s, _ in run_layout.step_dirs(tmp_path / "rollouts")] == [2, 3]
    got = receivers[1].receive(3)
    assert got == tiny_batch(3, 1)
    assert receivers[0].receive(9, should_stop=lambda: True) is None
    sender.discard_from(3)
    assert [s for s, _ in run_layout.step_dirs(tmp_path / "rollouts")] == [2]


def test_zmq_transport_serves_each_rank_its_batch_even_if_asked_first():
    config = ZMQTransport(port=_free_port())
    sender = ZMQSender(config)
    receivers = [ZMQReceiver(config, rank) for rank in range(2)]
    results: dict[int, TrainBatch | None] = {}

    def fetch(rank: int) -> None:
        results[rank] = receivers[rank].receive(5)

    threads = [threading.Thread(target=fetch, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()  # the ranks ask before the batch exists
    sender.send(5, [tiny_batch(5, 0), tiny_batch(5, 1)])
    for thread in threads:
        thread.join(timeout=10)
    assert results == {0: tiny_batch(5, 0), 1: tiny_batch(5, 1)}
    for receiver in receivers:
        receiver.close()
    sender.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_rl(tmp_path, text: str) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(text)
    return load_config(RLConfig, [str(path)], [])


def test_rollout_steps_kept_on_disk_cover_the_async_bound(tmp_path):
    # The orchestrator sends step n while the trainer may still wait for step n − max_async_level.
    config = load_rl(tmp_path, "max_async_level = 6\n")
    assert config.transport.keep_last == 7
    roles = split_config(config, on_gpu=False, num_cpus=2)
    sender = FilesystemSender(tmp_path, roles.orchestrator.transport)
    receiver = FilesystemReceiver(tmp_path, roles.trainer.transport, rank=0)
    for step in range(10):
        sender.send(step, [tiny_batch(step, 0)])
    assert receiver.receive(10 - 1 - 6, should_stop=lambda: True) == tiny_batch(3, 0)
    assert load_rl(tmp_path, "max_async_level = 2\n").transport.keep_last == 4  # the default when larger
    orchestrator = OrchestratorConfig(max_async_level=5)
    assert isinstance(orchestrator.transport, FilesystemTransport) and orchestrator.transport.keep_last == 6


def test_keep_last_set_below_the_async_bound_is_a_one_line_config_error(tmp_path):
    text = 'max_async_level = 4\n[transport]\ntype = "filesystem"\nkeep_last = 4\n'
    with pytest.raises(UserError) as info:
        load_rl(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message and "transport.keep_last" in message and "max_async_level" in message
    with pytest.raises(ValueError, match="max_async_level"):
        OrchestratorConfig(max_async_level=3, transport={"type": "filesystem", "keep_last": 2})
    assert load_rl(tmp_path, text.replace("keep_last = 4", "keep_last = 5")).transport.keep_last == 5


def test_online_eval_defaults_to_the_runs_own_environments_held_out(tmp_path):
    config = load_rl(
        tmp_path,
        '[[orchestrator.env]]\nname = "wordle"\nkwargs = { num_examples = 20000 }\n'
        "[orchestrator.online_eval]\ninterval = 10\n",
    )
    (spec,) = config.orchestrator.online_eval.env
    assert spec.name == "wordle" and spec.display_name == "wordle"
    # a built-in: its other split, the games the run does not train on, as many as online eval asks for
    assert spec.kwargs == {"num_examples": 50, "split": "heldout"}
    custom = OrchestratorConfig(
        env=[{"name": "my_pkg.envs:Maze", "kwargs": {"seed": 7}}], online_eval={"interval": 5}
    )
    assert (
        custom.online_eval.env[0].kwargs["seed"] == 7 + HELDOUT_SEED_OFFSET
    )  # another seed: other instances
    mixed = OrchestratorConfig(
        env=[
            {"name": "reverse_text", "kwargs": {"num_examples": 20000, "seed": 1}},
            {"name": "math", "label": "gsm8k", "kwargs": {"dataset": "openai/gsm8k", "subset": "main"}},
        ],
        online_eval={"interval": 5, "num_tasks": 30},
    )
    reverse, gsm8k = mixed.online_eval.env
    assert reverse.kwargs == {"num_examples": 30, "seed": 1, "split": "heldout"}
    assert gsm8k.display_name == "gsm8k" and gsm8k.kwargs["split"] == "test"
    explicit = OrchestratorConfig(env=[{"name": "wordle"}], online_eval={"env": [{"name": "math"}]})
    assert [s.name for s in explicit.online_eval.env] == ["math"]


def test_orchestrator_ckpt_interval_is_gone_because_state_is_saved_every_step(tmp_path):
    # a resumed trainer restarts from any step it checkpointed (SIGTERM included): the orchestrator keeps a
    # state per step from that checkpoint on, so a key claiming "every N steps" would be a setting ignored
    with pytest.raises(UserError, match="orchestrator.ckpt_interval: unknown key"):
        load_rl(tmp_path, "[orchestrator]\nckpt_interval = 5\n")


def test_step_metrics_across_ranks_weigh_tokens_sum_counts_and_take_the_slowest_time():
    """Two ranks' merged loss metrics combine into what one rank seeing all micro-batches would report."""
    from tidal.trainer.loss import merge_loss_metrics
    from tidal.trainer.rl import across_ranks

    def micro(tokens: int, nonfinite: int, kl: float, masked: float, ratio_max: float) -> dict[str, float]:
        return {
            "num_loss_tokens": tokens, "num_nonfinite": nonfinite, "mismatch_kl": kl, "masked_fraction": masked,
            "ratio_mean": 1.0 + kl, "ratio_max": ratio_max, "entropy": 2.0 * kl,
        }  # fmt: skip

    ranks = [[micro(10, 0, 0.1, 0.2, 1.5), micro(30, 2, 0.3, 0.0, 2.0)], [micro(60, 1, 0.5, 0.5, 3.0)]]
    local = [
        {**merge_loss_metrics(parts), "loss": loss, "tokens": float(sum(p["num_loss_tokens"] for p in parts)),
         "elapsed": elapsed}
        for parts, loss, elapsed in zip(ranks, (0.25, -0.5), (1.0, 3.0), strict=True)
    ]  # fmt: skip

    def gather(values: list[float]) -> list[list[float]]:  # what all_gather returns on every rank
        from tidal.trainer.rl import RANK_METRICS

        rows = [[row.get(k, 0.0) for k in RANK_METRICS] for row in local]
        assert values == rows[0]  # rank 0 sends its own
        return rows

    combined = across_ranks(local[0], gather)
    everything = merge_loss_metrics(ranks[0] + ranks[1])
    for key, want in everything.items():
        assert combined[key] == pytest.approx(want), key
    assert combined["mismatch_kl"] == pytest.approx((10 * 0.1 + 28 * 0.3 + 59 * 0.5) / 97)
    assert combined["masked_fraction"] == pytest.approx((10 * 0.2 + 60 * 0.5) / 100)
    assert combined["num_nonfinite"] == 3 and combined["ratio_max"] == 3.0
    assert combined["loss"] == pytest.approx(-0.25) and combined["tokens"] == 100
    assert combined["elapsed"] == 3.0  # the step took as long as its slowest rank


def test_replicas_get_consecutive_ports_their_own_cores_and_gpus_and_the_orchestrator_all_urls():
    rl = RLConfig.model_validate(
        {
            "deployment": {
                "num_replicas": 3,
                "inference_cpus": "0-3,6",
                "inference_gpus": [4, 5, 6, 7, 2, 3],
            },
            "inference": {
                "server": {"port": 9100, "log_file": "/tmp/vllm.log"},
                "vllm": {"tensor_parallel_size": 2},
            },
        }
    )
    cpu = split_config(rl, on_gpu=False, num_cpus=8)
    assert [r.server.port for r in cpu.replicas] == [9100, 9101, 9102]
    assert cpu.orchestrator.client.urls == [f"http://127.0.0.1:{p}" for p in (9100, 9101, 9102)]
    assert [r.cpu.omp_threads_bind for r in cpu.replicas] == ["0-1", "2-3", "6"]
    assert [r.server.log_file for r in cpu.replicas] == [f"/tmp/vllm_{i}.log" for i in range(3)]
    assert cpu.replica_gpus == ()
    gpu = split_config(rl, on_gpu=True, num_cpus=8)
    assert gpu.replica_gpus == ((4, 5), (6, 7), (2, 3))
    assert all(r.cpu.omp_threads_bind == "auto" for r in gpu.replicas)  # untouched on GPUs


def test_two_replicas_on_two_cores_share_the_inference_core_unless_given_cores():
    two = RLConfig.model_validate({"deployment": {"num_replicas": 2}})
    assert [r.cpu.omp_threads_bind for r in split_config(two, on_gpu=False, num_cpus=2).replicas] == [
        "0",
        "0",
    ]
    spread = RLConfig.model_validate({"deployment": {"num_replicas": 2, "inference_cpus": "0-1"}})
    assert [r.cpu.omp_threads_bind for r in split_config(spread, on_gpu=False, num_cpus=2).replicas] == [
        "0",
        "1",
    ]
    one = split_config(RLConfig(), on_gpu=False, num_cpus=2)
    assert len(one.replicas) == 1 and one.inference.server.port == 8000


def test_cpu_defaults_come_from_the_cores_the_run_was_given_not_the_machine(monkeypatch):
    """A run given cores 4-7 of 8 (Slurm, a cpuset, taskset) binds vLLM to 4-5 and trains on 2 threads;
    given core 3 alone, both use core 3 and the trainer 1 thread. os.cpu_count() would say 8 every time."""
    from tidal.config import deployment
    from tidal.launcher.sft import threads_per_rank

    monkeypatch.setattr(deployment.os, "sched_getaffinity", lambda pid: {7, 4, 6, 5})
    assert deployment.usable_cores() == [4, 5, 6, 7]
    roles = split_config(RLConfig(), on_gpu=False)
    assert roles.replicas[0].cpu.omp_threads_bind == "4-5" and roles.trainer.num_threads == 2
    assert threads_per_rank(load_config(SFTConfig, [str(REPO / "configs/ci/sft_tiny.toml")], [])) == 4
    monkeypatch.setattr(deployment.os, "sched_getaffinity", lambda pid: {3})
    roles = split_config(RLConfig(), on_gpu=False)
    assert roles.replicas[0].cpu.omp_threads_bind == "3" and roles.trainer.num_threads == 1


def test_replica_gpu_and_core_mistakes_are_one_line_errors(tmp_path):
    short = RLConfig.model_validate({"deployment": {"num_replicas": 2, "inference_gpus": [0, 1, 2]}})
    with pytest.raises(UserError, match=r"deployment.inference_gpus: lists 3 GPU\(s\) for 2 replica\(s\)"):
        split_config(short, on_gpu=True)
    with pytest.raises(UserError, match="deployment.inference_cpus"):
        load_rl(tmp_path, '[deployment]\ninference_cpus = "0-x"\n')
    with pytest.raises(UserError, match="deployment.inference_cpus"):
        load_rl(tmp_path, '[deployment]\nnum_replicas = 2\ninference_cpus = "0-1|2-3"\n')
    assert (
        load_rl(tmp_path, '[deployment]\ninference_cpus = "0-1|2-3"\n').deployment.inference_cpus == "0-1|2-3"
    )
    too_high = RLConfig.model_validate(
        {"deployment": {"num_replicas": 2}, "inference": {"server": {"port": 65535}}}
    )
    with pytest.raises(UserError, match="inference.server.port"):
        split_config(too_high, on_gpu=False)


def test_cluster_split_points_the_orchestrator_at_every_replica_on_every_inference_node():
    rl = RLConfig.model_validate(
        {
            "deployment": {
                "type": "slurm", "num_inference_nodes": 2, "num_replicas": 2, "num_trainer_nodes": 2,
                "num_trainer_ranks": 4,
            },
            "inference": {"server": {"port": 9000, "admin_token": "t"}},
            "transport": {"type": "zmq", "port": 6000},
        }
    )  # fmt: skip
    roles = split_config(
        rl, on_gpu=False, num_cpus=8, addresses=["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    )
    assert roles.orchestrator.client.urls == [
        "http://10.0.0.1:9000", "http://10.0.0.1:9001", "http://10.0.0.2:9000", "http://10.0.0.2:9001"
    ]  # fmt: skip
    assert roles.replica_nodes == (0, 0, 1, 1) and roles.node_replicas(1) == [2, 3]
    assert {r.server.host for r in roles.replicas} == {"0.0.0.0"}  # reachable from the orchestrator's node
    # trainer ranks on nodes 2 and 3 connect to the orchestrator on the first trainer node
    assert roles.trainer.transport.host == roles.orchestrator.transport.host == "10.0.0.3"
    assert roles.orchestrator.batch.num_trainer_ranks == 8
    with pytest.raises(UserError, match="4 nodes are needed, 2 given"):
        split_config(rl, on_gpu=False, addresses=["a", "b"])


def test_more_than_one_node_needs_a_cluster_type(tmp_path):
    with pytest.raises(UserError, match="deployment.num_trainer_nodes: more than one node needs"):
        load_rl(tmp_path, "[deployment]\nnum_trainer_nodes = 2\n")


def test_trainer_command_joins_a_rendezvous_on_several_nodes():
    from tidal.launcher.rl import trainer_argv

    assert trainer_argv(Path("t.toml"), 1)[-4:] == ["tidal", "trainer", "@", "t.toml"]
    single = trainer_argv(Path("t.toml"), 2)
    assert "--standalone" in single and single[single.index("--nproc-per-node") + 1] == "2"
    multi = trainer_argv(Path("t.toml"), 8, num_nodes=4, rendezvous="10.0.0.3:29400", run_id="job7")
    assert "--standalone" not in multi
    assert (
        multi[multi.index("--nnodes") + 1] == "4"
        and multi[multi.index("--rdzv-endpoint") + 1] == "10.0.0.3:29400"
    )
    assert (
        multi[multi.index("--rdzv-backend") + 1] == "c10d" and multi[multi.index("--rdzv-id") + 1] == "job7"
    )


def test_the_orchestrator_and_the_trainer_start_while_vllm_loads_held_before_a_shared_gpu():
    from tidal.launcher.supervisor import GATED_TRAINER, roles_while_loading, started_roles

    both = ("inference", "trainer", "orchestrator")
    # a machine without GPUs: nothing shared, both start beside vLLM
    assert roles_while_loading(both, set(), [0]) == ["orchestrator", "trainer"]
    # one GPU shared by vLLM and the trainer: vLLM sizes its cache from the memory free while it starts, so
    # the trainer starts too but waits at the gate before its first CUDA call
    assert roles_while_loading(both, {0}, [0]) == ["orchestrator", GATED_TRAINER]
    assert roles_while_loading(both, {0, 1}, [1, 2]) == ["orchestrator", GATED_TRAINER]
    assert roles_while_loading(both, {0}, [1, 2]) == ["orchestrator", "trainer"]
    # a cluster node with only replicas, or only the trainer
    assert roles_while_loading(("inference",), {0}, [0]) == []
    assert roles_while_loading(("trainer",), set(), [0]) == ["trainer"]
    assert started_roles(["trainer", "orchestrator"], {"trainer", "orchestrator"}) == (
        "trainer and orchestrator started while vLLM loaded"
    )
    assert started_roles(["trainer", "orchestrator"], {"orchestrator"}) == (
        "orchestrator started while vLLM loaded; trainer started"
    )


def test_a_gated_trainer_waits_for_the_gate_file_and_an_ungated_one_not_at_all(tmp_path, capsys):
    import threading

    from tidal.trainer.rl import wait_for_gate

    assert wait_for_gate(None) == 0.0 and wait_for_gate("") == 0.0
    gate = tmp_path / "trainer" / "gpu_gate"
    gate.parent.mkdir()
    opener = threading.Timer(0.3, gate.touch)
    opener.start()
    waited = wait_for_gate(str(gate), poll_s=0.02)
    opener.join()
    assert 0.25 < waited < 5
    assert "waited" in capsys.readouterr().out
    assert wait_for_gate(str(gate)) < 0.1  # a restarted trainer finds it open


def test_the_orchestrator_waits_for_inference_as_long_as_tidal_rl_does(tmp_path):
    roles = split_config(RLConfig(startup_timeout=900.0), on_gpu=False)
    assert roles.orchestrator.client.startup_timeout == 900
    with pytest.raises(UserError) as raised:
        load_config(RLConfig, [], [("orchestrator.client.startup_timeout", 30.0)])
    problem = str(raised.value)  # names the key and the top-level setting to use instead
    assert problem.count("startup_timeout") >= 2 and "orchestrator.client.startup_timeout" in problem


def test_the_admin_token_is_the_configured_one_else_the_environments_else_a_new_one_per_run():
    configured = RLConfig.model_validate({"inference": {"server": {"admin_token": "a"}}})
    assert run_admin_token(configured, {"TIDAL_ADMIN_TOKEN": "env"}, shared=False) == "a"
    client_only = RLConfig.model_validate({"orchestrator": {"client": {"admin_token": "c"}}})
    assert run_admin_token(client_only, {}, shared=False) == "c"
    assert run_admin_token(RLConfig(), {"TIDAL_ADMIN_TOKEN": "env"}, shared=False) == "env"
    made = {run_admin_token(RLConfig(), {}, shared=False) for _ in range(2)}
    assert len(made) == 2 and all(t is not None and len(t) == 64 for t in made)
    # the nodes of a cluster run must agree: none is made up on one (the job or the Secret provides it)
    assert run_admin_token(RLConfig(), {}, shared=True) is None


def test_tidal_rl_gives_replicas_and_orchestrator_a_run_token_in_their_environment_only(
    tmp_path, monkeypatch
):
    """Issue 34: a local run without a configured token left the replicas' admin routes open to every
    process on the host. The token it makes is in the environment of the processes that call those routes,
    not in the trainer's, not in any file of the output dir, and a restarted child gets the same one."""
    import sys

    from tidal.launcher.rl import LocalLauncher

    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    rl = RLConfig.model_validate({"output_dir": str(tmp_path), "deployment": {"num_replicas": 2}})
    roles = split_config(rl, on_gpu=False, num_cpus=4)
    launcher = LocalLauncher(rl)
    env = launcher._child_env(roles, False, [0, 1])
    token = env["inference_0"]["TIDAL_ADMIN_TOKEN"]
    assert env["inference_1"]["TIDAL_ADMIN_TOKEN"] == env["orchestrator"]["TIDAL_ADMIN_TOKEN"] == token
    assert "TIDAL_ADMIN_TOKEN" not in env["trainer"] and env["trainer"]["CUDA_VISIBLE_DEVICES"] == ""
    assert LocalLauncher(rl)._child_env(roles, False, [0, 1])["orchestrator"]["TIDAL_ADMIN_TOKEN"] != token
    show = [sys.executable, "-c", "import os; print(os.environ['TIDAL_ADMIN_TOKEN'])"]
    try:
        first = launcher.children.start("inference_0", show, env["inference_0"])
        first.process.wait(timeout=60)
        launcher.children.restart("inference_0").process.wait(timeout=60)
    finally:
        launcher.children.stop_all()
        launcher.children.close()
    assert (tmp_path / "logs" / "inference_0.log").read_text().split() == [token, token]
    (tmp_path / "logs" / "inference_0.log").unlink()
    launcher._write_configs(roles, [0, 1])
    assert not any(token in p.read_text() for p in tmp_path.rglob("*") if p.is_file())


def test_a_configured_token_stays_out_of_the_role_configs_and_the_dry_run():
    rl = RLConfig.model_validate(
        {
            "inference": {"server": {"admin_token": "configured-s3cret"}},
            "orchestrator": {"client": {"admin_token": "configured-s3cret"}},
        }
    )
    roles = split_config(rl, on_gpu=False, num_cpus=4)
    assert roles.inference.server.admin_token is None and roles.orchestrator.client.admin_token is None
    from tidal.launcher.rl import dry_run

    assert "configured-s3cret" not in dry_run(rl)


def test_a_gated_single_rank_trainer_loads_on_the_cpu_before_it_waits_and_joins(tmp_path, monkeypatch):
    import tidal.trainer.rl as rl
    import tidal.trainer.session as session
    from tidal import run_layout
    from tidal.config.rl import RLTrainerConfig

    calls: list[str] = []
    monkeypatch.setattr(rl, "join_distributed", lambda info: calls.append("join"))
    monkeypatch.setattr(rl, "wait_for_gate", lambda gate: calls.append(f"gate {gate}"))

    def fake_train(config, info, before_gpu=None):
        calls.append("load on the cpu")
        if before_gpu is not None:
            before_gpu()
        calls.append("to the gpu")
        return 0

    monkeypatch.setattr(rl, "train", fake_train)
    config = RLTrainerConfig(output_dir=tmp_path, device="cpu")
    monkeypatch.setenv(run_layout.TRAINER_GATE_ENV, "/run/gate")
    assert rl.main(config) == 0
    assert calls == ["load on the cpu", "gate /run/gate", "join", "to the gpu"]
    calls.clear()
    monkeypatch.delenv(run_layout.TRAINER_GATE_ENV)
    assert rl.main(config) == 0
    assert calls == ["gate None", "join", "load on the cpu", "to the gpu"]
    calls.clear()
    monkeypatch.setenv(run_layout.TRAINER_GATE_ENV, "/run/gate")
    monkeypatch.setenv("WORLD_SIZE", "2")  # several ranks agree on a checkpoint first: through the gate first
    monkeypatch.setattr(rl, "shutdown", lambda info: None)
    assert rl.main(config) == 0
    assert calls == ["gate /run/gate", "join", "load on the cpu", "to the gpu"]

    # open_trainer calls it once the model is loaded, before parallelize moves it to the device
    order: list[str] = []
    monkeypatch.setenv("WORLD_SIZE", "1")

    def stop_at_parallelize(*args, **kwargs):
        order.append("parallelize")
        raise RuntimeError("stop here")

    monkeypatch.setattr(session, "parallelize", stop_at_parallelize)
    info = rl.plan_distributed("cpu")
    with pytest.raises(RuntimeError, match="stop here"):
        session.open_trainer(
            RLTrainerConfig(output_dir=tmp_path / "t", device="cpu"), info, tmp_path / "t" / "m.jsonl",
            tmp_path / "t" / "ckpt", lambda: order.append("before the gpu"),
        )  # fmt: skip
    assert order == ["before the gpu", "parallelize"]

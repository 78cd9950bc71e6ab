"""Fixtures for tests that start real vLLM servers: one shared server per session, weights to switch to."""

import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ranks import free_port
from tidal.config.inference import InferenceConfig
from tidal.inference.server import ServerProcess, start_server
from tidal.testing import TINY_MODEL_NAME, resolve_model_name

SERVER_STARTUP_TIMEOUT = 180.0
LORA_RANK = 8


def non_loopback_ip() -> str | None:
    """This machine's address on its first real interface (what another host would connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            ip = str(sock.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


SHARED_MAX_MODEL_LEN = 2048
"""The shared servers' context, the tiny model's whole: room for an agent environment's prompt (swe's tools
and bug report are ~1,090 tokens of the tiny model's nearly char-level tokenizer) and a turn."""


def tiny_server_config(port: int, core: str, log_file: Path, **server: Any) -> InferenceConfig:
    """The tiny model in float32 (so logprobs compare tightly with transformers), pinned to one core."""
    return InferenceConfig.model_validate(
        {
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "server": {"port": port, "log_file": str(log_file), **server},
            "vllm": {
                "max_model_len": SHARED_MAX_MODEL_LEN,
                "enforce_eager": True,
                "enable_lora": True,
                "max_lora_rank": LORA_RANK,
            },
            # the worker inside the engine process: each server starts ~10 s sooner
            "cpu": {"kvcache_space_gib": 1, "omp_threads_bind": core, "worker_process": False},
        }
    )


def start_ready(config: InferenceConfig) -> ServerProcess:
    server = start_server(config)
    try:
        server.wait_ready(SERVER_STARTUP_TIMEOUT)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return Path(resolve_model_name(TINY_MODEL_NAME))


@pytest.fixture(scope="session")
def admin_token() -> str:
    return secrets.token_hex(16)


@dataclass
class ServerPair:
    """The shared server and a spare one for the two-server client test (which kills and restarts it)."""

    main: ServerProcess
    spare: ServerProcess
    spare_config: InferenceConfig


@pytest.fixture(scope="session")
def server_pair(tmp_path_factory: pytest.TempPathFactory, admin_token: str) -> Iterator[ServerPair]:
    """Both servers start side by side, each pinned to its own core: one startup's wall time for two.

    The main one binds every interface (so the guard can be tested from a non-loopback address), hence
    the admin token. Tests that change its weights restore them.
    """
    logs = tmp_path_factory.mktemp("vllm")
    main_config = tiny_server_config(
        free_port(), "0", logs / "main.log", host="0.0.0.0", admin_token=admin_token
    )
    spare_config = tiny_server_config(free_port(), "1", logs / "spare.log", admin_token=admin_token)
    main, spare = start_server(main_config), start_server(spare_config)
    try:
        main.wait_ready(SERVER_STARTUP_TIMEOUT)
        spare.wait_ready(SERVER_STARTUP_TIMEOUT)
        yield ServerPair(main, spare, spare_config)
    finally:
        main.stop()
        spare.stop()


@pytest.fixture(scope="session")
def inference_server(server_pair: ServerPair) -> ServerProcess:
    return server_pair.main


@pytest.fixture(scope="session")
def perturbed_weights(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with Gaussian noise on every weight, published as step 1 of a fake training run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import FilesystemPublisher

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    run_dir = tmp_path_factory.mktemp("run")
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    return FilesystemPublisher(run_dir).publish(1, model, tokenizer, info)


@pytest.fixture(scope="session")
def lora_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 PEFT adapter on q_proj/v_proj of both layers (written by hand: peft is not needed)."""
    import json

    import torch
    from safetensors.torch import save_file

    target = tmp_path_factory.mktemp("lora")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": TINY_MODEL_NAME,
    }
    (target / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(LORA_RANK, 128, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(128, LORA_RANK, generator=generator)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return target

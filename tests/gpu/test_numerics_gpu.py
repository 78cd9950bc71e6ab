"""GPU numerics: trainer logprobs agree with vLLM's in bf16; FSDP2 on two GPUs trains like one GPU.

Both run the real commands (`tidal rl`, `tidal sft`, torchrun) so they test whatever the trainer does today,
not a copy of it. Run through the device tool with the vLLM bundle on PYTHONPATH (see benchmarks/results/
gpu_tests_h200x2.txt for the command); the measured numbers are printed (`pytest -s`).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.ranks import free_port
from tidal.testing import RANDOM_QWEN3_0_6B, TINY_MOE_MODEL_NAME

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# KL(μ‖π) per token between vLLM's sampling distribution and the trainer's for the same bf16 weights.
# Kernels differ (vLLM: FlashAttention, fused norms; trainer: PyTorch SDPA), so it is not zero; an
# off-by-one target or a wrong temperature gives 1e-1 and more.
MISMATCH_KL_BOUND = 1e-3
# Relative loss difference per step between 1 and 2 FSDP ranks: bf16 keeps 8 mantissa bits (4e-3 per
# rounding); only the order of gradient sums differs, which stays well inside one bf16 step over 5 steps.
LOSS_REL_BOUND = 1e-2

RL_CONFIG = """
max_steps = 3
seed = 0
max_async_level = 0

[model]
name = "{model}"

[deployment]
inference_gpus = [{inference_gpu}]
trainer_gpus = [0]

[inference.server]
port = {port}

[inference.vllm]
max_model_len = 1024
enforce_eager = true
gpu_memory_utilization = 0.3

[orchestrator.batch]
num_prompts = 8
group_size = 4
advantage = "std"
zero_signal = "keep"
seq_len = 4096

[orchestrator.sampling]
temperature = 1.0
max_tokens = 128

[trainer.optim]
lr = 1e-5
"""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


def test_trainer_logprobs_match_vllm_in_bf16(tmp_path: Path) -> None:
    """Synchronous RL (max_async_level 0) on Qwen3-0.6B's shape: every batch is scored by the trainer with
    the very weights vLLM sampled it with (step 0: the bf16 checkpoint; later: the published update), so
    the trainer's mismatch_kl measures numerics alone."""
    config = tmp_path / "rl.toml"
    inference_gpu = 1 if torch.cuda.device_count() > 1 else 0
    config.write_text(
        RL_CONFIG.format(model=RANDOM_QWEN3_0_6B, inference_gpu=inference_gpu, port=free_port())
    )
    out = tmp_path / "rl"
    result = run(
        [sys.executable, "-m", "tidal", "rl", "@", str(config), "--output-dir", str(out)], {}, timeout=420
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    trainer = read_jsonl(out / "trainer" / "metrics.jsonl")
    orchestrator = read_jsonl(out / "orchestrator" / "metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1, 2]
    assert all(r["off_policy/max"] == 0 for r in orchestrator)  # same weights on both sides
    kls = [r["mismatch_kl/mean"] for r in trainer]
    print(
        f"\nMEASURED mismatch_kl per step (bf16, Qwen3-0.6B shape, 32 x 128 tokens): {kls}; "
        f"ratio/mean {[round(r['ratio/mean'], 6) for r in trainer]}; bound {MISMATCH_KL_BOUND}"
    )
    for record in trainer:
        # zero would mean the trainer never recomputed anything (two bf16 stacks never agree to the bit)
        assert 0 < record["mismatch_kl/mean"] < MISMATCH_KL_BOUND, record
        assert record["masked_fraction"] == 0.0, record
        assert record["nonfinite_tokens"] == 0, record


def sft_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}


def sft_one_and_two_gpus(tmp_path: Path, extra: list[str], two_only: list[str]) -> tuple[dict, dict]:
    """`tidal sft` for 5 steps on one GPU and under torchrun on two (`two_only` added there), both at once:
    the same global batches, so the same loss curve up to bf16 noise. Returns both runs' losses."""
    common = ["sft", "@", "configs/ci/sft_tiny.toml", "--max-steps", "5", "--ckpt.interval", "5", *extra]
    one = [sys.executable, "-m", "tidal", *common, "--output-dir", str(tmp_path / "one")]
    two = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "tidal", *common, *two_only, "--output-dir", str(tmp_path / "two"),
    ]  # fmt: skip
    # both at once: the tiny model leaves the GPUs nearly idle, and device time is what this costs
    procs = [
        subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": devices},
        )
        for argv, devices in ((one, "0"), (two, "0,1"))
    ]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    assert "2 rank(s)" in outputs[1]
    return sft_losses(tmp_path / "one"), sft_losses(tmp_path / "two")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    ("what", "extra", "two_only"),
    [
        ("fsdp", [], []),
        # the tiny MoE (8 experts, top-2), 4 on each GPU, tokens exchanged by NCCL all-to-all
        ("ep", ["--model.name", TINY_MOE_MODEL_NAME, "--moe.aux-loss-coef", "0"], ["--perf.ep", "2"]),
        # both GPUs take every row, each runs half of its tokens (all-to-all over heads in attention)
        ("cp", [], ["--perf.cp", "2"]),
    ],
    ids=["fsdp", "ep", "cp"],
)
def test_two_gpus_match_one_gpu(tmp_path: Path, what: str, extra: list[str], two_only: list[str]) -> None:
    """FSDP2, expert parallelism and context parallelism over two GPUs (NCCL) train the loss curve of one."""
    single, sharded = sft_one_and_two_gpus(tmp_path, extra, two_only)
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4, 5]
    rel = {s: abs(sharded[s] - single[s]) / abs(single[s]) for s in single}
    print(
        f"\nMEASURED {what}: sft loss 1 GPU {single}\n         sft loss 2 GPUs {sharded}\n"
        f"         max relative difference {max(rel.values()):.2e} (bound {LOSS_REL_BOUND})"
    )
    assert single[5] < single[1]  # it trains: the comparison is between moving curves
    for step, diff in rel.items():
        assert diff < LOSS_REL_BOUND, (step, single[step], sharded[step])

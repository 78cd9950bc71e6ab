"""LoRA in the trainer: step 0 equals the base, merging equals the adapted forward, PEFT export, frozen base."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.unit import models
from tidal.config.common import OptimConfig
from tidal.config.lora import LoraConfig, vllm_lora_rank
from tidal.config.perf import PerfConfig
from tidal.errors import UserError
from tidal.models.tiny import build_tokenizer
from tidal.trainer import ckpt
from tidal.trainer.lora import (
    LoraLinear,
    apply_lora,
    export_adapter,
    lora_scaling,
    merge_lora,
    peft_config,
    trainable_state_dict,
)
from tidal.trainer.optim import build_optimizer
from tidal.trainer.parallel import DistInfo, parallelize, shutdown
from tidal.trainer.publish import FilesystemPublisher
from tidal.transport.weights import is_adapter_dir, list_published

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
LORA = LoraConfig(rank=4, alpha=8.0)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    return models.tiny_lm(seed, layers=2)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, targets [2, 12]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (2, 12), generator=gen)
    return ids, torch.arange(12).expand(2, -1), torch.randint(0, 61, (2, 12), generator=gen)


def randomize_adapters(model: torch.nn.Module, seed: int = 3) -> None:
    """B starts at zero (no effect): give it values, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=gen))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def test_adapted_model_starts_equal_to_the_base_and_keeps_hf_names() -> None:
    base, model = tiny_lm(), tiny_lm()
    adapted = apply_lora(model, LORA)
    assert len(adapted) == 2 * len(PROJECTIONS) and all(
        isinstance(model.get_submodule(n), LoraLinear) for n in adapted
    )
    names = set(model.state_dict())
    assert set(base.state_dict()) == {n for n in names if ".lora_" not in n}
    assert {n for n in names if ".lora_" in n} == {f"{m}.lora_{x}.weight" for m in adapted for x in "AB"}
    ids, _, _ = batch()
    torch.testing.assert_close(logits(model, ids), logits(base, ids), rtol=0, atol=0)
    randomize_adapters(model)
    assert (logits(model, ids) - logits(base, ids)).abs().max() > 1e-3


def test_merged_weights_equal_the_adapted_forward() -> None:
    model = tiny_lm()
    apply_lora(model, LORA)
    randomize_adapters(model)
    merged = merge_lora(model.state_dict(), lora_scaling(model))
    plain = tiny_lm(seed=7)
    plain.load_state_dict(merged)  # strict: exactly the HF names, no adapter tensors left
    ids, _, _ = batch()
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    assert lora_scaling(model) == LORA.alpha / 4


def test_only_adapters_get_gradients_and_optimizer_state() -> None:
    model = tiny_lm()
    apply_lora(model, LORA)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    scorer = parallelize(model, CPU, PerfConfig(activation_checkpointing="full", loss_chunk_tokens=5))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in trainable}
    ids, positions, targets = batch()
    for _ in range(2):
        logprobs, _ = scorer(ids, positions, targets)
        (-logprobs.mean()).backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == (".lora_" in name), name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert set(optimizer.state) == set(trainable)
    for name, p in model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base_before[name]), name
    assert all(m.lora_B.weight.abs().sum() > 0 for m in model.modules() if isinstance(m, LoraLinear))


def test_adapter_export_has_peft_names_and_config_and_no_base_weights(tmp_path: Path) -> None:
    model = tiny_lm()
    adapted = apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    randomize_adapters(model)
    config = peft_config(LoraConfig(rank=4, alpha=8.0), adapted, "tiny")
    target = export_adapter(tmp_path / "adapter", model, config, CPU, torch.bfloat16)
    assert sorted(p.name for p in target.iterdir()) == [
        ".complete",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tensors = load_file(str(target / "adapter_model.safetensors"))
    want = {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{x}.weight"
        for i in range(2)
        for m in ("q_proj", "v_proj")
        for x in "AB"
    }
    assert set(tensors) == want
    q = model.get_submodule("model.layers.1.self_attn.q_proj")
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert a.shape == (4, 32) and a.dtype == torch.bfloat16
    torch.testing.assert_close(a, q.lora_A.weight.detach().to(torch.bfloat16))
    saved = json.loads((target / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8.0
    assert saved["target_modules"] == ["q_proj", "v_proj"] and saved["base_model_name_or_path"] == "tiny"


def test_publisher_with_an_adapter_config_publishes_adapters_only(tmp_path: Path) -> None:
    model = tiny_lm()
    adapted = apply_lora(model, LORA)
    publisher = FilesystemPublisher(tmp_path, keep_last=2, adapter_config=peft_config(LORA, adapted, "tiny"))
    for step in (1, 2, 3):
        publisher.publish(step, model, build_tokenizer(), CPU)
    published = list_published(tmp_path)
    assert [step for step, _ in published] == [2, 3]
    for _, path in published:
        assert is_adapter_dir(path) and not list(path.glob("model*.safetensors"))
        assert (path / "adapter_model.safetensors").stat().st_size < 100_000


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "autocast"])
def test_lora_under_bf16_compute_trains_adapters_and_exports_them(fsdp: bool) -> None:
    """The GPU paths on CPU, bf16 compute: a 1-rank FSDP2 group (frozen and trainable params in one group), or
    autocast over the fp32 weights without FSDP2 (one GPU's default)."""
    model = tiny_lm()
    apply_lora(model, LORA)
    ids, positions, targets = batch()
    try:
        perf = PerfConfig(mixed_precision="bf16", activation_checkpointing="full", fsdp=fsdp)
        scorer = parallelize(model, CPU, perf)
        assert (scorer.autocast_dtype is None) == fsdp
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
        logprobs, _ = scorer(ids, positions, targets)
        (-logprobs.mean()).backward()
        assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
        optimizer.step()
        state = trainable_state_dict(model)
    finally:
        shutdown(CPU)
        assert not dist.is_initialized()
    assert state and all(".lora_" in name and value.dtype == torch.float32 for name, value in state.items())
    assert all(value.abs().sum() > 0 for name, value in state.items() if "lora_B" in name)


def test_checkpoint_of_a_lora_run_restores_adapters_and_optimizer(tmp_path: Path) -> None:
    def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = tiny_lm()
        apply_lora(model, LORA)
        return model, build_optimizer(model, OptimConfig(lr=1e-2))

    model, optimizer = setup()
    ids, positions, targets = batch()
    scorer = parallelize(model, CPU, PerfConfig())
    (-scorer(ids, positions, targets)[0].mean()).backward()
    optimizer.step()
    ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, CPU, keep_last=1)
    reader = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "step_1" / "model_optim"))
    saved = [key for key in reader.read_metadata().state_dict_metadata if key.startswith("model.")]
    assert saved and all(".lora_" in key for key in saved), [k for k in saved if ".lora_" not in k]
    restored, restored_optimizer = setup()
    ckpt.load_checkpoint(tmp_path / "step_1", restored, restored_optimizer, CPU)
    for (name, p), q in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        torch.testing.assert_close(q, p, msg=name)
    trained = [optimizer.state[p]["exp_avg"] for p in model.parameters() if p.requires_grad]
    loaded = [restored_optimizer.state[p]["exp_avg"] for p in restored.parameters() if p.requires_grad]
    assert len(loaded) == len(trained) == 2 * 2 * len(PROJECTIONS)
    for want, got in zip(trained, loaded, strict=True):
        torch.testing.assert_close(got, want)
    assert any(m.abs().sum() > 0 for m in loaded)  # B's moments (A's gradient is 0 while B is 0)


def test_bad_targets_are_one_line_user_errors() -> None:
    with pytest.raises(UserError, match=r"\['qproj'\] match no nn.Linear.*q_proj"):
        apply_lora(tiny_lm(), LoraConfig(rank=4, target_modules=["q_proj", "qproj"]))
    with pytest.raises(ValueError, match="output head"):
        LoraConfig(rank=4, target_modules=["lm_head"])
    assert apply_lora(tiny_lm(), LoraConfig()) == [] and not LoraConfig(rank=0).enabled


def test_vllm_lora_rank_rounds_up_to_a_rank_vllm_accepts() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]


def test_tidal_rl_turns_on_lora_in_vllm_for_a_lora_trainer() -> None:
    from tidal.config.rl import RLConfig
    from tidal.launcher.split import split_config

    roles = split_config(RLConfig.model_validate({"trainer": {"lora": {"rank": 12}}}), False, 2)
    vllm = roles.inference.vllm
    assert vllm.enable_lora and vllm.max_lora_rank == 16 and vllm.max_loras == 2
    assert roles.trainer.lora.rank == 12
    assert not split_config(RLConfig(), False, 2).inference.vllm.enable_lora


@pytest.mark.parametrize(
    "override,fragments",
    [
        (["--trainer.publish.type", "nccl"], ["trainer.publish.type", "LoRA", "filesystem"]),
        (["--trainer.lora.target-modules", '["lm_head"]'], ["trainer.lora.target_modules", "output head"]),
        (["--trainer.lora.dropout", "1.5"], ["trainer.lora.dropout", "less than 1"]),
    ],
    ids=["nccl", "lm_head", "dropout"],
)
def test_bad_lora_configs_are_one_line_errors(override: list[str], fragments: list[str]) -> None:
    from tidal.config.loader import load_config, parse_args
    from tidal.config.rl import RLConfig

    with pytest.raises(UserError) as error:
        load_config(RLConfig, [], parse_args(["--trainer.lora.rank", "8", *override]).overrides)
    assert error.value.exit_code == 2 and len(str(error.value).splitlines()) == 1
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))

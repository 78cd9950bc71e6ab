"""LoRA for the trainers: frozen base weights, trainable low-rank A/B beside each target nn.Linear.

    y = x·Wᵀ + b + (alpha / rank) · dropout(x)·Aᵀ·Bᵀ        A [rank, in] (random), B [out, rank] (zero)

`apply_lora` replaces each target `nn.Linear` by a `LoraLinear` that holds the *same* weight and bias
Parameters under the same names (`…q_proj.weight`) plus `…q_proj.lora_A.weight` / `…lora_B.weight`, so
exports, checkpoints and the chunked head keep reading HF names. It runs before `parallelize`: FSDP2 shards
frozen and trainable parameters of a layer in one group, and the optimizer only sees `requires_grad` ones.

Adapters are written in PEFT's format (`adapter_config.json` + `adapter_model.safetensors` with names
`base_model.model.<module path>.lora_A.weight`), which vLLM's `/v1/load_lora_adapter` and PEFT read.
"""

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tidal.config.lora import LoraConfig
from tidal.errors import UserError
from tidal.trainer.export import full_state_dict
from tidal.trainer.model import vision_tower
from tidal.trainer.parallel import DistInfo, barrier
from tidal.transport.weights import ADAPTER_CONFIG, finish_staged, save_hf_checkpoint

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoraLinear(nn.Linear):
    """An nn.Linear (same weight/bias Parameters, same names) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # nn.Linear's (and PEFT's) init
        nn.init.zeros_(self.lora_B.weight)  # the update starts at zero: step 0 is the base model
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)  # [..., out]
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def matches(module_name: str, target: str) -> bool:
    """PEFT's rule: the module path equals the target or ends with `.<target>`."""
    return module_name == target or module_name.endswith("." + target)


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Freeze `model` and put a LoraLinear on every target nn.Linear; returns the adapted module paths."""
    if not config.enabled:
        return []
    assert config.rank is not None
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in config.target_modules if not any(matches(n, t) for n, _ in linears)]
    if unmatched:
        known = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
        raise UserError(
            f"lora.target_modules: {unmatched} match no nn.Linear of {type(model).__name__} (it has {known})"
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    # a vision-language model's tower keeps its weights: vLLM puts adapters on the language model only
    tower = vision_tower(model)
    in_tower = set(tower.modules()) if tower is not None else set()
    linears = [(n, m) for n, m in linears if m not in in_tower]
    targets = [(n, m) for n, m in linears if any(matches(n, t) for t in config.target_modules)]
    if any(m is head for _, m in targets):
        raise UserError("lora.target_modules: the output head cannot carry LoRA (the trainer scores with it)")
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(module, config.rank, config.alpha, config.dropout))
    return [name for name, _ in targets]


def peft_config(config: LoraConfig, adapted: list[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a causal LM (the fields vLLM and PEFT read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in adapted}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def is_lora_key(name: str) -> bool:
    return name.endswith((_A, _B))


def to_peft_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model state dict under PEFT's names (`base_model.model.<path>.lora_A.weight`)."""
    return {PEFT_PREFIX + name: value for name, value in state_dict.items() if is_lora_key(name)}


def merge_lora(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain HF state dict: W + scaling · B @ A for every adapted layer, adapter tensors dropped (pure)."""
    merged = {name: value for name, value in state_dict.items() if not is_lora_key(name)}
    for name in state_dict:
        if name.endswith(_A):
            prefix = name[: -len(_A)]
            lora_a, lora_b = state_dict[name].float(), state_dict[prefix + _B].float()
            weight = merged[prefix + ".weight"]
            merged[prefix + ".weight"] = (weight.float() + scaling * lora_b @ lora_a).to(weight.dtype)
    return merged


def lora_scaling(model: nn.Module) -> float:
    scalings = {m.scaling for m in model.modules() if isinstance(m, LoraLinear)}
    assert len(scalings) == 1, f"expected one LoRA scaling, found {scalings}"
    return scalings.pop()


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather only the trainable (adapter) parameters, unsharded, on CPU; a collective under FSDP.

    The frozen base is never gathered, so publishing costs the adapter's size, not the model's. (Not
    `get_model_state_dict(ignore_frozen_params=True)`: it still gathers a tied lm_head, the vocabulary-sized
    embedding, because the tied name is missing from named_parameters where the frozen check looks.)
    """
    state = {}
    for name, param in model.named_parameters():  # the same order on every rank: collectives match
        if param.requires_grad:
            value = param.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            state[name] = value.cpu()
    return state


def save_adapter(
    target: Path, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any], dtype: torch.dtype | None
) -> Path:
    """Write a PEFT adapter directory atomically: staging name, rename, then the `.complete` marker."""
    from safetensors.torch import save_file

    target = Path(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    peft = {
        name: (value.to(dtype) if dtype is not None else value).detach().cpu().contiguous()
        for name, value in to_peft_names(tensors).items()
    }
    assert peft, "no LoRA tensors to save"
    save_file(peft, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2))
    return finish_staged(staging, target)


def export_adapter(
    target: Path,
    model: nn.Module,
    adapter_config: dict[str, Any],
    info: DistInfo,
    dtype: torch.dtype | None = None,
) -> Path:
    """Gather the adapter on every rank, write it on rank 0 (floating tensors in `dtype`), wait for it."""
    tensors = trainable_state_dict(model)
    if info.is_main:
        save_adapter(target, tensors, adapter_config, dtype)
    barrier(info)
    return target


def export_merged(
    target: Path, model: nn.Module, tokenizer: Any, info: DistInfo, dtype: torch.dtype | None = None
) -> Path:
    """The adapted model as a plain HF checkpoint (adapters merged into the weights); a collective."""
    state = full_state_dict(model)
    if info.is_main:
        merged = merge_lora(state, lora_scaling(model))
        save_hf_checkpoint(target, merged, model.config, tokenizer, dtype)  # type: ignore[arg-type]
    barrier(info)
    return target

"""Write a complete HF checkpoint (config, safetensors, tokenizer, generation config) atomically.

The directory appears under its final name only when every file is written, and a `.complete` marker is the
last thing created, so a reader polling for new weights never loads half a checkpoint.
"""

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tidal.trainer.parallel import DistInfo, barrier

COMPLETE_MARKER = ".complete"


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the unsharded state dict on CPU (a collective: every rank must call it)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def save_hf_checkpoint(
    target: Path,
    state_dict: dict[str, torch.Tensor],
    hf_config: Any,
    tokenizer: Any,
    dtype: torch.dtype | None = None,
) -> Path:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    target = Path(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {}
    for name, tensor in state_dict.items():
        if getattr(hf_config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue  # tied to embed_tokens; safetensors refuses shared storage and loaders re-tie it
        tensor = tensor.detach().to("cpu")
        tensors[name] = (
            tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        ).contiguous()
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if dtype is not None:
        hf_config = copy.deepcopy(hf_config)  # the trainer's own config keeps describing its master weights
        hf_config.dtype = dtype
    hf_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    ).save_pretrained(staging)
    return finish_staged(staging, target)


def finish_staged(staging: Path, target: Path) -> Path:
    """Move a fully written `staging` directory to `target` (replacing it), then mark it complete: a reader
    that sees the marker never sees a half-written directory."""
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    (target / COMPLETE_MARKER).touch()
    return target


def export_model(
    target: Path, model: torch.nn.Module, tokenizer: Any, info: DistInfo, dtype: torch.dtype | None = None
) -> Path:
    """Gather on every rank, write on rank 0 (floating tensors cast to `dtype` when given), wait for it."""
    state_dict = full_state_dict(model)
    if info.is_main:
        hf_config = model.config  # type: ignore[attr-defined]
        save_hf_checkpoint(target, state_dict, hf_config, tokenizer, dtype)
    barrier(info)
    return target

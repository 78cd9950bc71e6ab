"""Gather an (FSDP-sharded) model and write it as a complete HF checkpoint (format: tidal.transport.weights).

The directory appears under its final name only when every file is written, and a `.complete` marker is the
last thing created, so a reader polling for new weights never loads half a checkpoint.
"""

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tidal.errors import write_error
from tidal.trainer.moe import checkpoint_tensors, fused_expert_params
from tidal.trainer.parallel import DistInfo, barrier
from tidal.transport.weights import save_hf_checkpoint


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the unsharded state dict on CPU (a collective: every rank must call it), under HF checkpoint
    names: fused MoE expert tensors are split per expert (tidal.trainer.moe.checkpoint_tensors)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tensors = ((name, value) for name, value in state.items() if isinstance(value, torch.Tensor))
    return dict(checkpoint_tensors(tensors, fused_expert_params(model)))


def export_model(
    target: Path, model: torch.nn.Module, tokenizer: Any, info: DistInfo, dtype: torch.dtype | None = None
) -> Path:
    """Gather on every rank, write on rank 0 (floating tensors cast to `dtype` when given), wait for it."""
    state_dict = full_state_dict(model)
    if info.is_main:
        write_checkpoint(target, state_dict, model, tokenizer, dtype)
    barrier(info)
    return target


def write_checkpoint(
    target: Path,
    state_dict: dict[str, torch.Tensor],
    model: torch.nn.Module,
    tokenizer: Any,
    dtype: Any,
    static: dict[str, bytes] | None = None,
) -> None:
    """Write `state_dict` as `model`'s HF checkpoint (`static`: its other files, made once; see
    save_hf_checkpoint); a full disk or a read-only directory is one line."""
    try:
        save_hf_checkpoint(target, state_dict, model.config, tokenizer, dtype, static)  # type: ignore[attr-defined]
    except Exception as exc:
        problem = write_error(target, exc)
        if problem is None:
            raise
        raise problem from None

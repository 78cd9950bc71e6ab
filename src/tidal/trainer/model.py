"""Load an HF causal LM (or a vision-language model, its vision tower frozen unless asked) by config: a hub id,
a local dir or a tiny test model."""

import torch

from tidal.config.common import ModelConfig
from tidal.errors import UserError, first_line
from tidal.models import resolve_model_name
from tidal.models.vision import VISION_TOWERS

_DTYPES = {
    "auto": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars and info logs; tidal prints its own progress."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def load_model(config: ModelConfig, master_dtype: str = "float32") -> torch.nn.Module:
    """Load on CPU with parameters in the master dtype (perf.master_dtype), whatever model.dtype is.

    model.dtype is what inference serves and weights are published in (`served_dtype`); the trainer's
    parameters, gradients and optimizer update stay fp32 (`parallelize` sets the compute dtype).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tidal.models.vision import sees_images

    path = resolve_model_name(config.name)
    vision = sees_images(path)
    if config.train_vision and not vision:
        raise UserError(f"model.train_vision: model {config.name!r} has no vision tower (no vision_config)")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(
            path,
            dtype=_DTYPES[master_dtype],
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name = {config.name!r}: cannot load model: {first_line(exc)}") from None
    model.config.use_cache = False
    if vision and not config.train_vision:
        freeze_vision_tower(model)
    return model


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's vision encoder (at one of VISION_TOWERS under its base model); None for a
    model without one."""
    base = getattr(model, str(getattr(model, "base_model_prefix", "model")), model)
    for name in VISION_TOWERS:
        tower = getattr(base, name, None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop the vision encoder's parameters from training (the connector into the language model trains);
    the number of parameters frozen. A vision-language model whose encoder is not found: ValueError."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"{type(model).__name__}: no vision encoder at {' or '.join(VISION_TOWERS)}")
    frozen = 0
    for param in tower.parameters():
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen


def export_dtype(config: ModelConfig) -> torch.dtype | None:
    """The dtype `tidal sft` writes final/ in: model.dtype when set, else None (the fp32 masters as trained)."""
    return None if config.dtype == "auto" else _DTYPES[config.dtype]


def served_dtype(config: ModelConfig, publish_dtype: str = "auto") -> torch.dtype | None:
    """The dtype inference computes in, so weights can be published in it (None: keep the trainer's).

    An explicit publish dtype wins; then model.dtype (inference gets the same `--dtype`); under `auto`
    vLLM serves the checkpoint's stored dtype, read from its config.json.
    """
    named = config.served_dtype(publish_dtype)
    if named != "auto":
        return _DTYPES[named]
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(
            resolve_model_name(config.name), trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError):
        return None  # load_model has already reported a model it cannot load
    stored = getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else None

"""Load an HF causal LM and its tokenizer by config (hub id, local dir or the tiny test model)."""

import torch

from tidal.config.common import ModelConfig
from tidal.errors import UserError, first_line
from tidal.models import resolve_model_name

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
    from transformers import AutoModelForCausalLM

    path = resolve_model_name(config.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=_DTYPES[master_dtype],
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name = {config.name!r}: cannot load model: {first_line(exc)}") from None
    model.config.use_cache = False
    return model


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

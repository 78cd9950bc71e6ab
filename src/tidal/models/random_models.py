"""Random-weight models with a real model's architecture, built locally for GPU benchmarks and numerics tests.

`tidal-testing/random-qwen3-0.6b` has Qwen3-0.6B's exact shapes (28 layers, hidden 1024, GQA 16/8 heads,
151,936-token vocabulary, tied embeddings) with random weights and the tiny model's char-level tokenizer
padded to Qwen's vocabulary size, so it costs what Qwen3-0.6B costs to serve and to train without a
download; `tidal-testing/random-qwen3-1.7b` does the same for Qwen3-1.7B (28 layers, hidden 2048). Random
weights never learn to stop: completions run to `max_tokens`, which then sets the length.

`tidal-testing/small-qwen3` is a char-level Qwen3 between the two (8 layers, hidden 512, the tiny model's
unpadded 101-token vocabulary): big enough to learn the example environments from their demonstrations in a
few minutes of one GPU, where the CPU's tiny model does not (the one-GPU recipes in examples/*/).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.models.tiny import build_tokenizer, cache_dir, seeded_model, write_model_dir

RANDOM_QWEN3_0_6B = "tidal-testing/random-qwen3-0.6b"
RANDOM_QWEN3_1_7B = "tidal-testing/random-qwen3-1.7b"
SMALL_QWEN3 = "tidal-testing/small-qwen3"

# Qwen/Qwen3-0.6B's config.json (architecture fields only).
QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
}


# Qwen/Qwen3-1.7B's config.json (architecture fields only).
QWEN3_1_7B_CONFIG: dict[str, Any] = {
    **QWEN3_0_6B_CONFIG,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}


# A char-level model for the one-GPU recipes: the tiny model's tokenizer without padding (4 special tokens and
# 97 characters), a standard init and RoPE base; ~25M parameters.
SMALL_QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": 101,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class RandomModelSpec:
    """How to build one named random model: its cache directory, architecture and stored dtype."""

    dir_name: str
    config: dict[str, Any]
    dtype: str = "bfloat16"
    """Stored dtype: the real checkpoint's (vLLM serves it in this dtype; the trainer upcasts to fp32)."""
    seed: int = 0


# Bump a dir_name's version when its recipe changes so cached copies are rebuilt instead of reused.
RANDOM_MODELS: dict[str, RandomModelSpec] = {
    RANDOM_QWEN3_0_6B: RandomModelSpec("random-qwen3-0.6b-v1", QWEN3_0_6B_CONFIG),
    RANDOM_QWEN3_1_7B: RandomModelSpec("random-qwen3-1.7b-v1", QWEN3_1_7B_CONFIG),
    # fp32 like the tiny model: trained from scratch, never served as a released checkpoint
    SMALL_QWEN3: RandomModelSpec("small-qwen3-v1", SMALL_QWEN3_CONFIG, dtype="float32"),
}


def random_model_dir(name: str) -> str | None:
    """The directory of one of `RANDOM_MODELS`, built on first use; None for any other name."""
    spec = RANDOM_MODELS.get(name)
    if spec is None:
        return None
    target = cache_dir() / spec.dir_name
    if not (target / "config.json").exists():
        build_random_model(target, spec)
    return str(target)


def build_random_model(target: Path, spec: RandomModelSpec) -> Path:
    """Write a seeded random Qwen3 of `spec`'s shape and the padded char tokenizer to `target` atomically."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(spec.config["vocab_size"])
    tokenizer.model_max_length = spec.config["max_position_embeddings"]
    config = Qwen3Config(
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=spec.dtype,
        **spec.config,
    )
    # initialise in fp32 (the same numbers on any machine), then round once to the stored dtype
    model = seeded_model(Qwen3ForCausalLM, config, spec.seed).to(getattr(torch, spec.dtype))
    return write_model_dir(Path(target), model, tokenizer)

"""A deterministic, locally built char-level Qwen3 (~0.44M parameters) for tests and CPU demos.

No download: the tokenizer is a character vocabulary (printable ASCII plus newline and tab) with ChatML
special tokens, and the model is a randomly initialised Qwen3 with a fixed seed. Both are written in HF
format, so `AutoModelForCausalLM`, `AutoTokenizer` and vLLM load the directory like any hub model.

`tidal-testing/tiny-qwen3` uses plain ChatML; `tidal-testing/tiny-qwen3-chat` is the same model and
vocabulary with a Qwen3-style chat template (`tidal.models.templates`: `<think>` blocks on the last
assistant turn only, reasoning stripped from earlier turns, tool results in `<tool_response>` user turns),
for multi-turn runs that meet a template which re-renders history. `<think>` is plain characters there.

`tidal-testing/tiny-qwen3-moe` is a char-level Qwen3-MoE (`Qwen3MoeForCausalLM`) with the same vocabulary,
ChatML template, attention and embedding shapes: every layer's MLP is a sparse block of a few small experts
with top-2 routing and normalised top-k weights (as in Qwen3-30B-A3B), for MoE training and serving on CPU.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tidal.models.templates import QWEN3_STYLE_TEMPLATE

TINY_MODEL_NAME = "tidal-testing/tiny-qwen3"
TINY_CHAT_MODEL_NAME = "tidal-testing/tiny-qwen3-chat"
TINY_MOE_MODEL_NAME = "tidal-testing/tiny-qwen3-moe"
# Bump when the recipe changes so cached copies are rebuilt instead of silently reused.
_RECIPE_VERSION = "v2"
_CHAT_RECIPE_VERSION = "v1"
_MOE_RECIPE_VERSION = "v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]

# ChatML, as Qwen uses it; every turn ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    # A short RoPE base and a wider init let 2 layers learn to copy past the 40-character system prompt
    # quickly (measured: SFT loss after 150 steps 2.85 with 1e4/0.02, 0.30 with 1e3/0.1).
    "rope_theta": 1000.0,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

# The MoE variant: attention and embeddings as TINY_CONFIG; each layer's MLP is a sparse block of experts.
TINY_MOE_CONFIG: dict[str, Any] = {
    **{key: value for key, value in TINY_CONFIG.items() if key != "intermediate_size"},
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001,
}


def cache_dir() -> Path:
    root = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")
    return Path(root) / "models"


def tiny_model_dir(name: str) -> str | None:
    """The directory of `tidal-testing/tiny-qwen3`, `…/tiny-qwen3-chat` or `…/tiny-qwen3-moe`, built on first
    use; None for any other name (tidal.models.resolve_model_name resolves every name)."""
    if name == TINY_MOE_MODEL_NAME:
        target = cache_dir() / f"tiny-qwen3-moe-{_MOE_RECIPE_VERSION}"
        if not (target / "config.json").exists():
            build_tiny_moe_model(target)
        return str(target)
    if name in (TINY_MODEL_NAME, TINY_CHAT_MODEL_NAME):
        chat = name == TINY_CHAT_MODEL_NAME
        target = cache_dir() / (
            f"tiny-qwen3-chat-{_CHAT_RECIPE_VERSION}" if chat else f"tiny-qwen3-{_RECIPE_VERSION}"
        )
        if not (target / "config.json").exists():
            build_tiny_model(target, chat_template=QWEN3_STYLE_TEMPLATE if chat else CHAT_TEMPLATE)
        return str(target)
    return None


def build_tokenizer(
    vocab_size: int | None = None, chat_template: str = CHAT_TEMPLATE
):  # -> PreTrainedTokenizerFast
    """The char-level tokenizer; `vocab_size` pads the vocabulary with unused `<|filler_i|>` entries so a
    random model with a real model's vocabulary (e.g. Qwen3's 151936) can be served and decoded."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL_TOKENS + CHARS
    if vocab_size is not None:
        tokens += [f"<|filler_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # A BPE model without merges splits text into single characters; Fuse() joins them back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(target: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write the tiny model and tokenizer to `target` atomically (safe if several ranks race)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build_char_model(target, Qwen3Config, Qwen3ForCausalLM, TINY_CONFIG, seed, chat_template)


def build_tiny_moe_model(target: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write the tiny Qwen3-MoE and the char tokenizer to `target` atomically (HF's per-expert weight names)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _build_char_model(
        target, Qwen3MoeConfig, Qwen3MoeForCausalLM, TINY_MOE_CONFIG, seed, chat_template
    )


def seeded_model(model_class: Any, config: Any, seed: int) -> Any:
    """`model_class(config)` initialised from `seed`, the caller's random state left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)


def _build_char_model(
    target: Path, config_class: Any, model_class: Any, shape: dict[str, Any], seed: int, chat_template: str
) -> Path:
    """A seeded fp32 model of `shape` over the char tokenizer, written with it to `target`."""

    tokenizer = build_tokenizer(chat_template=chat_template)
    config = config_class(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **shape,
    )
    return write_model_dir(Path(target), seeded_model(model_class, config, seed), tokenizer)


def write_model_dir(target: Path, model: Any, tokenizer: Any, processor: Any = None) -> Path:
    """Save model, tokenizer (and a multimodal model's processor) and a greedy generation config to `target`
    via a staging dir and one rename."""
    from transformers import GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if processor is not None:
            processor.save_pretrained(staging)
        GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
        ).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (
                target / "config.json"
            ).exists():  # lost the race to a half-written dir? never: rename is atomic
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

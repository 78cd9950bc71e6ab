"""A tiny random Qwen3 causal LM for unit tests of the trainer's pure pieces (no files, no hub)."""

import torch


def tiny_lm(seed: int = 0, tied: bool = True, layers: int = 3, kv_heads: int = 2) -> torch.nn.Module:
    """Vocabulary 61, hidden 32, 4 query / 2 key-value heads of 8 (or `kv_heads`): small enough for exact CPU
    comparisons."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, tie_word_embeddings=tied, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.config.use_cache = False
    return model

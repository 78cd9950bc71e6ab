"""Local test assets: a tiny char-level Qwen3 model and tokenizer that transformers and vLLM both load."""

from tidal.testing.tiny import TINY_MODEL_NAME, build_tiny_model, resolve_model_name

__all__ = ["TINY_MODEL_NAME", "build_tiny_model", "resolve_model_name"]

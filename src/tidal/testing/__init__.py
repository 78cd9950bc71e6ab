"""Local test assets: the tiny char-level Qwen3 and random-weight real-shape models, built without downloads."""

from tidal.testing.random_models import RANDOM_QWEN3_0_6B
from tidal.testing.tiny import TINY_MODEL_NAME, build_tiny_model, resolve_model_name

__all__ = ["RANDOM_QWEN3_0_6B", "TINY_MODEL_NAME", "build_tiny_model", "resolve_model_name"]

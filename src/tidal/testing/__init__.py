"""Local test assets, built without downloads: the tiny char-level Qwen3 (ChatML or a Qwen3-style chat
template), its mixture-of-experts variant, and random-weight real-shape models."""

from tidal.models import resolve_model_name
from tidal.testing.random_models import RANDOM_QWEN3_0_6B, RANDOM_QWEN3_1_7B, SMALL_QWEN3
from tidal.testing.tiny import (
    TINY_CHAT_MODEL_NAME,
    TINY_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    build_tiny_model,
    build_tiny_moe_model,
    resolve_test_model,
)

__all__ = [
    "RANDOM_QWEN3_0_6B",
    "RANDOM_QWEN3_1_7B",
    "SMALL_QWEN3",
    "TINY_CHAT_MODEL_NAME",
    "TINY_MODEL_NAME",
    "TINY_MOE_MODEL_NAME",
    "build_tiny_model",
    "build_tiny_moe_model",
    "resolve_model_name",
    "resolve_test_model",
]

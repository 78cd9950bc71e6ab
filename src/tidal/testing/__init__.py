"""Test support, the top floor (tidal.layers): production code never imports it. The local test models
themselves are built by tidal.models (a config's `model.name` resolves them in every process), so this
package gathers their names for tests, beside the pinned real-model assets (tidal.testing.assets) and a
second chat-template family (tidal.testing.templates)."""

from tidal.models import resolve_model_name
from tidal.models.names import resolve_test_model
from tidal.models.random_models import RANDOM_QWEN3_0_6B, RANDOM_QWEN3_1_7B, SMALL_QWEN3
from tidal.models.tiny import (
    TINY_CHAT_MODEL_NAME,
    TINY_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    build_tiny_model,
    build_tiny_moe_model,
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

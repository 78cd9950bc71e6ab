"""Whether a model sees pictures: its config has a vision tower (`vision_config`), as every vision-language
model transformers and vLLM know declares (Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, Gemma 3, …)."""

import json
from pathlib import Path


def sees_images(model_path: str) -> bool:
    """True when the model at `model_path` (a local directory or a hub id) has a vision tower. A hub id's
    config is read through transformers (downloaded on first use, as vLLM would); an unreadable one is
    taken as a text model, which the command's own loading then reports."""
    config = Path(model_path) / "config.json"
    if config.is_file():
        try:
            return "vision_config" in json.loads(config.read_text())
        except (OSError, ValueError):
            return False
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
    except Exception:  # noqa: BLE001 - no network, no such repo, a custom architecture: not ours to report
        return False

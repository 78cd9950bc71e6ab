"""Whether a model sees pictures: its config has a vision tower (`vision_config`), as every vision-language
model transformers and vLLM know declares (Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, Gemma 3, …)."""

import json
from pathlib import Path


def sees_images(model_path: str) -> bool:
    """True when the config.json of the model at `model_path` (a local directory or a hub id) has a vision
    tower. Asked before every server start, so it reads the one file: a hub id's from the local cache, else
    downloaded (vLLM fetches it next anyway), never through transformers (seconds of imports). An unreadable
    one is taken as a text model, which the command's own loading then reports."""
    config = _config_file(model_path)
    if config is None:
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def _config_file(model_path: str) -> Path | None:
    local = Path(model_path) / "config.json"
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_path, "config.json")
        return Path(cached) if isinstance(cached, str) else Path(hf_hub_download(model_path, "config.json"))
    except Exception:  # noqa: BLE001 - no network, no such repo, not a repo id: not ours to report
        return None

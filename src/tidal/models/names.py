"""`resolve_model_name`: a config's model name as something `from_pretrained` and vLLM accept.

- a `.gguf` file: its Hugging Face directory in tidal's cache, converted on first use (tidal.models.gguf);
- `tidal-testing/...`: a local test model, built on first use (tidal.models.tiny, tidal.models.random_models);
- anything else (a hub id, an HF directory): unchanged.
"""

from tidal.models.gguf import Say, is_gguf_name, resolve_gguf
from tidal.models.random_models import random_model_dir
from tidal.models.tiny import tiny_model_dir
from tidal.models.tiny_vlm import tiny_vlm_dir


def prepare_model_files(name: str, say: Say) -> None:
    """Convert a GGUF `name` now, saying so, so that the processes a command starts next find it converted
    (each would otherwise wait on the lock of the one converting). Other names: nothing to do here."""
    if is_gguf_name(name):
        resolve_gguf(name, say)


def resolve_model_name(name: str, say: Say | None = None) -> str:
    """The directory or hub id to load for `name` (`say` reports a conversion that has to run first)."""
    if is_gguf_name(name):
        return str(resolve_gguf(name, say))
    return resolve_test_model(name)


def resolve_test_model(name: str) -> str:
    """The directory of a local test model (`tidal-testing/tiny-qwen3`, `…/tiny-qwen3-chat`,
    `…/tiny-qwen3-moe`, `…/tiny-idefics3` (a vision-language model), `…/random-qwen3-0.6b`, …), built on
    first use; any other name unchanged. Configs go through `resolve_model_name`, which also converts GGUF
    files."""
    found = tiny_model_dir(name)
    if found is None:
        found = tiny_vlm_dir(name)
    if found is None:
        found = random_model_dir(name)
    return name if found is None else found

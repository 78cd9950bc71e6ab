"""`resolve_model_name`: a config's model name as something `from_pretrained` and vLLM accept.

- a `.gguf` file: its Hugging Face directory in tidal's cache, converted on first use (tidal.models.gguf);
- `tidal-testing/...`: a local test model, built on first use (tidal.testing);
- anything else (a hub id, an HF directory): unchanged.
"""

from tidal.models.gguf import Say, is_gguf_name, resolve_gguf


def prepare_model_files(name: str, say: Say) -> None:
    """Convert a GGUF `name` now, saying so, so that the processes a command starts next find it converted
    (each would otherwise wait on the lock of the one converting). Other names: nothing to do here."""
    if is_gguf_name(name):
        resolve_gguf(name, say)


def resolve_model_name(name: str, say: Say | None = None) -> str:
    """The directory or hub id to load for `name` (`say` reports a conversion that has to run first)."""
    if is_gguf_name(name):
        return str(resolve_gguf(name, say))
    # the test models live with the tests' other assets; imported here only for their names
    from tidal.testing.tiny import resolve_test_model

    return resolve_test_model(name)

"""Model names and model files: what a config's `model.name` means on disk (hub id, HF directory, GGUF file,
or one of tidal's local test models), resolved the same way by every process of a run."""

from tidal.models.names import prepare_model_files, resolve_model_name

__all__ = ["prepare_model_files", "resolve_model_name"]

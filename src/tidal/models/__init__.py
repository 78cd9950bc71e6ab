"""Model names and model files: what a config's `model.name` means on disk (hub id, HF directory, GGUF file,
or one of tidal's local test models), resolved the same way by every process of a run."""

from tidal.models.names import resolve_model_name

__all__ = ["resolve_model_name"]

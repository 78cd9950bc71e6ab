"""Filesystem weight transport: the trainer publishes `<output_dir>/weights/step_<n>/`, inference loads it.

Each step is a complete HF checkpoint written by `save_hf_checkpoint` (staging name, rename, then the
`.complete` marker), so a server told to load a step never sees half of it.
"""

import re
import shutil
from pathlib import Path
from typing import Any

from tidal.trainer.export import COMPLETE_MARKER

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{step}"


def check_weights_dir(directory: str | Path) -> str | None:
    """Why `directory` cannot be loaded as new weights, or None when it can."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"weights directory {directory} does not exist"
    if not any(directory.glob("*.safetensors")):
        return f"no *.safetensors files in {directory}"
    # A model directory made by other tools has no marker; config.json under the final name is then the
    # sign that it was written completely (tidal renames complete directories into place).
    if not (directory / COMPLETE_MARKER).exists() and not (directory / "config.json").exists():
        return (
            f"{directory} has no {COMPLETE_MARKER} marker and no config.json: refusing a partial checkpoint"
        )
    return None


def list_published(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete published steps, oldest first."""
    root = Path(output_dir) / "weights"
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE_MARKER).exists():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_published(output_dir: Path) -> tuple[int, Path] | None:
    published = list_published(output_dir)
    return published[-1] if published else None


class WeightPublisher:
    """Writes one HF checkpoint per published step and prunes old ones (rank 0 writes, all ranks gather)."""

    def __init__(self, output_dir: Path, keep_last: int | None = 3, dtype: Any = None):
        # Two at least: a server may still be loading the previous step while the next one lands.
        if keep_last is not None and keep_last < 2:
            raise ValueError(f"keep_last must be at least 2 (or None to keep all), got {keep_last}")
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        # `publish_model` writes floating tensors in this torch dtype (None: as the model holds them)
        self.dtype = dtype

    def publish_state_dict(
        self, step: int, state_dict: dict[str, Any], hf_config: Any, tokenizer: Any, dtype: Any = None
    ) -> Path:
        """Write a full (unsharded) state dict as step `step`; call on one process only."""
        from tidal.trainer.export import save_hf_checkpoint

        target = save_hf_checkpoint(step_dir(self.output_dir, step), state_dict, hf_config, tokenizer, dtype)
        self._prune()
        return target

    def publish_model(self, step: int, model: Any, tokenizer: Any, info: Any) -> Path:
        """Gather an (FSDP-sharded) model on every rank and write it on rank 0 in `dtype`; a collective."""
        from tidal.trainer.export import export_model

        target = export_model(step_dir(self.output_dir, step), model, tokenizer, info, self.dtype)
        if info.is_main:
            self._prune()
        return target

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for _, path in list_published(self.output_dir)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

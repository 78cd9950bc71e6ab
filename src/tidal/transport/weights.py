"""Filesystem weight transport: the trainer publishes `<output_dir>/weights/step_<n>/`, inference loads it.

Each step is a complete HF checkpoint written by `save_hf_checkpoint` or, for LoRA runs, a PEFT adapter
directory (`adapter_config.json` + `adapter_model.safetensors`, never the base weights); both are written
under a staging name, renamed, then marked `.complete`, so a server told to load a step never sees half of it.
Inference loads a full checkpoint in place and hot-loads an adapter under `adapter_name(step)`.
"""

import re
import shutil
from pathlib import Path
from typing import Any

from tidal.errors import UserError
from tidal.trainer.export import COMPLETE_MARKER
from tidal.transport.weight_checks import non_finite_tensors

_STEP_DIR = re.compile(r"^step_(\d+)$")
ADAPTER_CONFIG = "adapter_config.json"


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{step}"


def is_adapter_dir(directory: str | Path) -> bool:
    """A published LoRA adapter (PEFT format) rather than full weights."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def adapter_name(step: int) -> str:
    """The name inference serves the adapter of `step` under (what requests pass as `model`)."""
    return f"policy-step-{step}"


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
    """Writes one HF checkpoint (or LoRA adapter) per published step and prunes old ones (rank 0 writes,
    all ranks gather)."""

    def __init__(
        self,
        output_dir: Path,
        keep_last: int | None = 3,
        dtype: Any = None,
        adapter_config: dict[str, Any] | None = None,
    ):
        # Two at least: a server may still be loading the previous step while the next one lands.
        if keep_last is not None and keep_last < 2:
            raise ValueError(f"keep_last must be at least 2 (or None to keep all), got {keep_last}")
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        # `publish_model` writes floating tensors in this torch dtype (None: as the model holds them)
        self.dtype = dtype
        # LoRA runs: publish only the adapter, with this adapter_config.json (see tidal.trainer.lora)
        self.adapter_config = adapter_config

    def publish_state_dict(
        self, step: int, state_dict: dict[str, Any], hf_config: Any, tokenizer: Any, dtype: Any = None
    ) -> Path:
        """Write a full (unsharded) state dict as step `step`; call on one process only."""
        from tidal.trainer.export import save_hf_checkpoint

        refuse_non_finite(step, non_finite_tensors(state_dict.items()))
        target = save_hf_checkpoint(step_dir(self.output_dir, step), state_dict, hf_config, tokenizer, dtype)
        self._prune()
        return target

    def publish_model(self, step: int, model: Any, tokenizer: Any, info: Any) -> Path:
        """Gather an (FSDP-sharded) model on every rank and write it on rank 0 in `dtype`; a collective.

        With an adapter config only the trainable LoRA tensors are gathered and written (PEFT format).
        Every rank checks its own shards for NaN/inf first and all refuse together (before the gather)."""
        refuse_non_finite(step, _local_non_finite(model, info))
        if self.adapter_config is not None:
            from tidal.trainer.lora import export_adapter

            target = export_adapter(
                step_dir(self.output_dir, step), model, self.adapter_config, info, self.dtype
            )
        else:
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


def refuse_non_finite(step: int, bad: list[str]) -> None:
    """Inference would load NaN/inf and every later completion would fail: stop the trainer instead."""
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"refusing to publish weights step_{step}: tensor {bad[0]}{more} has NaN/inf values "
            "(training diverged: lower the learning rate or check the loss and grad norm of the steps before)"
        )


def _local_non_finite(model: Any, info: Any) -> list[str]:
    """Non-finite parameters in this rank's shards; on a rank with none, the other ranks' count."""
    import torch

    named = [(name, _local(param.detach())) for name, param in model.named_parameters()]
    bad = non_finite_tensors(named)
    if not info.distributed:
        return bad
    count = torch.tensor([len(bad)], dtype=torch.int64, device=info.device)
    torch.distributed.all_reduce(count)
    total = int(count.item())
    return bad or ([f"on another rank ({total} tensor(s))"] if total else [])


def _local(tensor: Any) -> Any:
    """The shard this rank holds of an FSDP (DTensor) parameter, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

"""Filesystem weight format: the trainer publishes `<output_dir>/weights/step_<n>/`, inference loads it.

Each step is a complete HF checkpoint (`save_hf_checkpoint`) or, for LoRA runs, a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`, never the base weights); both are written under a
staging name, renamed, then marked `.complete`, so a server told to load a step never sees half of it.
Inference loads a full checkpoint in place and hot-loads an adapter under `adapter_name(step)`. An NCCL run
publishes the same directories holding only an announcement (tidal.transport.nccl), so the orchestrator
finds every step the same way.

This module is the format only: it imports no torch at module level (the orchestrator and the server's
guard read it) and nothing of the trainer; gathering a sharded model is tidal.trainer.publish's job.
"""

import copy
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tidal.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d+)$")
ADAPTER_CONFIG = "adapter_config.json"
COMPLETE_MARKER = ".complete"


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


def prune_published(output_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest `keep_last` published steps (None: keep all)."""
    if keep_last is None:
        return
    for _, path in list_published(output_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def check_keep_last(keep_last: int | None) -> None:
    # Two at least: a server may still be loading the previous step while the next one lands.
    if keep_last is not None and keep_last < 2:
        raise ValueError(f"keep_last must be at least 2 (or None to keep all), got {keep_last}")


def save_hf_checkpoint(
    target: Path,
    state_dict: dict[str, Any],
    hf_config: Any,
    tokenizer: Any,
    dtype: Any = None,
    static: dict[str, bytes] | None = None,
) -> Path:
    """Write a complete HF checkpoint (config, safetensors, tokenizer, generation config) atomically.

    `static`: those other files as `static_files` made them once (a publisher writes the same ones every
    step; serialising a real tokenizer again took 0.1-0.3 s a step)."""
    from safetensors.torch import save_file

    target = Path(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {}
    for name, tensor in state_dict.items():
        if getattr(hf_config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue  # tied to embed_tokens; safetensors refuses shared storage and loaders re-tie it
        tensor = tensor.detach().to("cpu")
        tensors[name] = (
            tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        ).contiguous()
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if static is None:
        write_static_files(staging, hf_config, tokenizer, dtype)
    else:
        for name, content in static.items():
            (staging / name).write_bytes(content)
    return finish_staged(staging, target)


def write_static_files(directory: Path, hf_config: Any, tokenizer: Any, dtype: Any = None) -> None:
    """A checkpoint's files besides its weights: config (its dtype the one written), tokenizer (a
    vision-language model's processor too, from the model it was loaded from), generation config (greedy,
    the tokenizer's EOS and padding)."""
    from transformers import GenerationConfig

    if dtype is not None:
        hf_config = copy.deepcopy(hf_config)  # the trainer's own config keeps describing its master weights
        hf_config.dtype = dtype
    hf_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if getattr(hf_config, "vision_config", None) is not None:  # vLLM and `tidal eval` need its processor too
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(hf_config._name_or_path).save_pretrained(directory)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    ).save_pretrained(directory)


def static_files(hf_config: Any, tokenizer: Any, dtype: Any = None) -> dict[str, bytes]:
    """`write_static_files`' files as bytes by name, to write again without serialising them again."""
    with tempfile.TemporaryDirectory() as tmp:
        write_static_files(Path(tmp), hf_config, tokenizer, dtype)
        return {path.name: path.read_bytes() for path in Path(tmp).iterdir() if path.is_file()}


def finish_staged(staging: Path, target: Path) -> Path:
    """Move a fully written `staging` directory to `target` (replacing it), then mark it complete: a reader
    that sees the marker never sees a half-written directory."""
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    (target / COMPLETE_MARKER).touch()
    return target


def refuse_non_finite(step: int, bad: list[str]) -> None:
    """Inference would load NaN/inf and every later completion would fail: stop the trainer instead."""
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"refusing to publish weights step_{step}: tensor {bad[0]}{more} has NaN/inf values "
            "(training diverged: lower the learning rate or check the loss and grad norm of the steps before)"
        )

"""Training-state checkpoints: sharded model + optimizer via torch.distributed.checkpoint, plus per-rank
scheduler, data position and RNG. Written to `step_<n>.tmp/` and renamed, so a crash mid-save never leaves a
checkpoint that looks complete."""

import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tidal.trainer.parallel import DistInfo, barrier

_STEP_DIR = re.compile(r"^step_(\d+)$")
# Frozen parameters (a LoRA run's base model) are not saved: resuming rebuilds them from the model the run
# names, so a LoRA checkpoint holds the adapters and their optimizer state, not a copy of the base.
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# loading: the dict holds exactly the trainable keys dcp.load filled (it fails on a missing one), so the
# frozen keys' absence is expected
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
# DCP warns on every single-process save that it assumes a single process; that is exactly our case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rng_state(info: DistInfo) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if info.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(info.device)
    return state


def set_rng_state(state: dict[str, Any], info: DistInfo) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and info.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], info.device)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    info: DistInfo,
    keep_last: int,
) -> Path:
    """Save everything needed to continue after `step` completed steps; returns the checkpoint dir."""
    final = root / f"step_{step}"
    staging = root / f"step_{step}.tmp"
    if info.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging / "model_optim"))
    torch.save({**extra, "step": step, "rng": rng_state(info)}, staging / f"trainer_state_rank{info.rank}.pt")
    barrier(info)
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        _prune(root, keep_last)
    barrier(info)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return max(steps)[1] if steps else None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG; return the rest of the saved state (step, data, ...)."""
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    dcp.load(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "model_optim")
    )  # fills in place
    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_LOAD_TRAINABLE
    )
    extra = torch.load(path / f"trainer_state_rank{info.rank}.pt", weights_only=False)
    set_rng_state(extra.pop("rng"), info)
    return extra


def _trainable_state_dicts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    params = dict(model.named_parameters())
    trainable = {name for name, p in params.items() if p.requires_grad}
    if len(trainable) < len(params):  # a tied output head is the frozen embedding under a second name
        model_sd = {key: value for key, value in model_sd.items() if key in trainable}
    return model_sd, optim_sd


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(
        (int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    )
    for _, path in steps[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)

"""Training-state checkpoints: sharded model + optimizer via torch.distributed.checkpoint, plus per-rank
scheduler, data position and RNG as plain JSON.

Written to `step_<n>.tmp/`, then rank 0 (after every rank finished) writes the manifest of every file's
size and sha256 (tidal.manifest) and renames the directory to `step_<n>/`: a crash mid-save leaves
only the staging directory, which nothing reads, and a checkpoint damaged later fails its manifest.

The per-rank state is JSON so that loading a checkpoint never runs code (a pickle would).

Test hook: with `TIDAL_TEST_CHECKPOINT_PAUSE=<step>:<seconds>` in the environment, saving checkpoint
`<step>` sleeps that long after the model/optimizer files are written (before the trainer state and the
manifest), and says so on stdout: tests kill a trainer at exactly that moment. Unset, it does nothing.
"""

import base64
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tidal import manifest
from tidal.errors import UserError, write_error
from tidal.trainer.parallel import DistInfo, barrier

PAUSE_ENV = "TIDAL_TEST_CHECKPOINT_PAUSE"
# Frozen parameters (a LoRA run's base model) are not saved: resuming rebuilds them from the model the run
# names, so a LoRA checkpoint holds the adapters and their optimizer state, not a copy of the base.
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# loading: the dict holds exactly the trainable keys dcp.load filled (it fails on a missing one), so the
# frozen keys' absence is expected
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
# DCP warns on every single-process save that it assumes a single process; that is exactly our case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rng_state(info: DistInfo) -> dict[str, Any]:
    """This process's RNG states as JSON-able data (byte states base64, numpy's key as a list)."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [kind, [int(k) for k in key], int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss_next],
    }
    if info.device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(info.device))
    return state


def set_rng_state(state: dict[str, Any], info: DistInfo) -> None:
    torch.set_rng_state(_from_b64(state["torch"]))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and info.device.type == "cuda":
        torch.cuda.set_rng_state(_from_b64(state["cuda"]), info.device)


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def state_file(path: Path, rank: int) -> Path:
    return path / f"trainer_state_rank{rank}.json"


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    info: DistInfo,
    keep_last: int,
) -> Path:
    """Save everything needed to continue after `step` completed steps; returns the checkpoint dir.

    `extra` must be JSON-able (scheduler state, data position): it is stored as plain data."""
    try:
        return _save(root, step, model, optimizer, extra, info, keep_last)
    except (Exception, CheckpointException) as exc:  # dcp's exception is a BaseException
        problem = write_error(root / f"step_{step}.tmp", exc)
        if problem is None:
            raise
        raise problem from None


def _save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    info: DistInfo,
    keep_last: int,
) -> Path:
    final = root / f"step_{step}"
    staging = root / f"step_{step}.tmp"
    if info.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging / "model_optim"))
    _pause_for_tests(step, info)
    trainer_state = {**extra, "step": step, "rng": rng_state(info)}
    state_file(staging, info.rank).write_text(json.dumps(trainer_state))
    barrier(info)  # every rank's files are written: only now can the manifest list them all
    if info.is_main:
        manifest.write_manifest(staging, step)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        _prune(root, step, keep_last)
    barrier(info)
    return final


def _pause_for_tests(step: int, info: DistInfo) -> None:
    """The documented test hook (module docstring): a no-op unless PAUSE_ENV names this step."""
    wanted, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    if wanted.strip() == str(step) and info.is_main:
        print(f"checkpoint step_{step}: pausing {seconds} s inside the write ({PAUSE_ENV})", flush=True)
        time.sleep(float(seconds))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint (manifest present, sizes match; no data read)."""
    found = manifest.complete_checkpoints(root)
    return found[-1][1] if found else None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG; return the rest of the saved state (step, data, ...)."""
    extra = load_trainer_state(path, info.rank)  # first: an old or foreign file fails before the big load
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    dcp.load(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "model_optim")
    )  # fills in place
    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_LOAD_TRAINABLE
    )
    set_rng_state(extra.pop("rng"), info)
    return extra


def load_trainer_state(path: Path, rank: int) -> dict[str, Any]:
    """This rank's trainer state as plain data; a pickled state of an older tidal is refused, not loaded
    (unpickling runs whatever code the file names)."""
    target = state_file(path, rank)
    if not target.exists():
        if (path / f"trainer_state_rank{rank}.pt").exists():
            raise UserError(
                f"--resume: {path} was written by a tidal before plain-data checkpoints "
                f"(trainer_state_rank{rank}.pt is a pickle, which is not loaded); start a new --output-dir"
            )
        raise UserError(f"--resume: {target} is missing (checkpoint written for fewer trainer ranks?)")
    try:
        state = json.loads(target.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"--resume: {target} is unreadable ({type(error).__name__})") from None
    if not isinstance(state, dict) or not {"step", "rng"} <= state.keys():
        raise UserError(f"--resume: {target} is not a tidal trainer state (no step / rng)")
    return state


def _trainable_state_dicts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    params = dict(model.named_parameters())
    trainable = {name for name, p in params.items() if p.requires_grad}
    if len(trainable) < len(params):  # a tied output head is the frozen embedding under a second name
        model_sd = {key: value for key, value in model_sd.items() if key in trainable}
    return model_sd, optim_sd


def _prune(root: Path, saved: int, keep_last: int) -> None:
    """Keep `keep_last` complete checkpoints (never the one just written); drop older broken ones and the
    staging directories of earlier saves a kill interrupted."""
    found = manifest.checkpoint_dirs(root)
    status = [(step, manifest.manifest_problem(path, check_hashes=False) is None) for step, path in found]
    paths = dict(found)
    doomed = [paths[step] for step in manifest.prune_plan(status, saved, keep_last)]
    doomed += [p for p in root.glob("step_*.tmp") if p.is_dir() and p.name != f"step_{saved}.tmp"]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)

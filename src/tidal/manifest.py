"""Which trainer checkpoints can be used: a checkpoint is complete only with its manifest.

`checkpoints/step_<n>/manifest.json` is written last (tmp + rename, by rank 0 after every rank finished its
files) and lists every file of the checkpoint with its size and sha256. A directory without it, or whose
files no longer match it (truncated, missing, altered), is not a checkpoint anyone resumes from.

Two strengths of check: `manifest_problem(..., check_hashes=True)` reads every byte and is what a resume
runs once, before anything starts (`resume_checkpoint`); the size-only check is cheap enough for the readers
that run later or often (the orchestrator's restore and its state pruning, checkpoint pruning). They agree
because the resume moves each checkpoint that failed the full check aside (`step_<n>.unusable`), so the
newest `step_<n>` left is the one that passed it. Stdlib only: the launcher and the orchestrator use it.
"""

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tidal.errors import UserError

MANIFEST = "manifest.json"
FORMAT = 1
UNUSABLE_SUFFIX = ".unusable"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20  # larger reads were slower per byte on the machine this was measured on
Report = Callable[[str], None]


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """`step_<n>` directories under root, oldest first (staging `.tmp` and `.unusable` names never match)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as fh:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while size := fh.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def _hash_all(paths: Sequence[Path]) -> list[str]:
    # hashlib drops the GIL on large updates: files hash in parallel on as many cores as there are
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(sha256_of, paths))


def _files_of(directory: Path) -> list[str]:
    """Every file under `directory` but the manifest, as sorted relative POSIX paths."""
    found = (p for p in directory.rglob("*") if p.is_file())
    return sorted(p.relative_to(directory).as_posix() for p in found if p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> dict[str, Any]:
    """List the files of a finished checkpoint with their sizes and hashes; the manifest itself appears
    at once (tmp + rename), so it is either absent or whole."""
    names = _files_of(directory)
    hashes = _hash_all([directory / name for name in names])
    files = {
        name: {"size": (directory / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, hashes, strict=True)
    }
    manifest = {"format": FORMAT, "step": step, "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read_manifest(directory: Path) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(files, None) from a well-formed manifest, else (None, what is wrong)."""
    path = directory / MANIFEST
    if not path.exists():
        if any(directory.glob("trainer_state_rank*.pt")):
            return None, (
                f"no {MANIFEST}: written by a tidal before checkpoint manifests (its pickled trainer state is "
                "not loaded); start a new --output-dir"
            )
        return None, f"no {MANIFEST}: the checkpoint is incomplete (its run stopped while writing it)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{MANIFEST} is unreadable ({type(error).__name__})"
    if not ok or not files:
        return None, f"{MANIFEST} is malformed (expected files with size and sha256)"
    return files, None


def files_problem(
    expected: dict[str, dict[str, Any]],
    sizes: dict[str, int | None],
    hashes: Callable[[list[str]], list[str]],
) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None (pure: `sizes` maps each listed
    file to its size, None when missing; `hashes` digests a list of files and is only called when all sizes
    match, so a truncated file is found without reading anything)."""
    for name, entry in expected.items():
        size = sizes.get(name)
        if size is None:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} is {size} bytes, the manifest says {entry['size']}"
    names = list(expected)
    for name, digest in zip(names, hashes(names), strict=True):
        if digest != expected[name]["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def manifest_problem(directory: Path, check_hashes: bool = True) -> str | None:
    """What makes this checkpoint unusable (one phrase naming the file), None when it is complete and
    intact; without `check_hashes` only presence and sizes are checked (no file is read)."""
    files, problem = read_manifest(directory)
    if files is None:
        return problem
    sizes = {name: _size(directory / name) for name in files}

    def hashes(names: list[str]) -> list[str]:
        if not check_hashes:
            return [files[name]["sha256"] for name in names]
        return _hash_all([directory / name for name in names])

    return files_problem(files, sizes, hashes)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def newest_usable(
    candidates: Sequence[tuple[int, Path]], problem: Callable[[Path], str | None]
) -> tuple[tuple[int, Path] | None, list[tuple[Path, str]]]:
    """The newest candidate without a problem, and the newer ones skipped with theirs (pure given
    `problem`; candidates oldest first, as `checkpoint_dirs` lists them; older ones are not checked)."""
    skipped: list[tuple[Path, str]] = []
    for step, path in reversed(candidates):
        found = problem(path)
        if found is None:
            return (step, path), skipped
        skipped.append((path, found))
    return None, skipped


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Checkpoints whose manifest is there and whose files have its sizes, oldest first (reads no data)."""
    return [(s, p) for s, p in checkpoint_dirs(root) if manifest_problem(p, check_hashes=False) is None]


def latest_complete_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint (size check); after `resume_checkpoint` ran, the one the
    trainer resumes from."""
    found = complete_checkpoints(root)
    return found[-1][0] if found else None


def resume_checkpoint(root: Path, report: Report) -> tuple[int, Path] | None:
    """The checkpoint a resume uses: the newest whose files all match its manifest (every byte read).

    Each newer one that does not is reported in one line and moved to `step_<n>.unusable`, so every
    process that later picks the newest complete checkpoint (`latest_complete_step`) picks this one.
    None when there is no checkpoint at all; a UserError when there are some and none is usable.
    """
    candidates = checkpoint_dirs(root)
    chosen, skipped = newest_usable(candidates, manifest_problem)
    for path, problem in skipped:
        aside = path.with_name(path.name + UNUSABLE_SUFFIX)
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        report(f"--resume: checkpoint {path.name} is unusable: {problem}; moved it to {aside.name}")
    if chosen is None and skipped:
        raise UserError(
            f"--resume: none of the {len(skipped)} checkpoint(s) in {root} is usable "
            f"(the newest, {skipped[0][0].name}: {skipped[0][1]}); start a new --output-dir"
        )
    return chosen


def prune_plan(checkpoints: Sequence[tuple[int, bool]], saved: int, keep_last: int) -> list[int]:
    """Steps to delete after checkpoint `saved` was written (pure; `checkpoints` are (step, complete)).

    The newest `keep_last` complete checkpoints up to `saved` stay, `saved` always among them; older
    incomplete ones go. Nothing newer than `saved` is touched: those are the leftovers of the run this one
    resumed, each rewritten when the run gets there (and skipped by a resume meanwhile if broken).
    """
    older = [(step, complete) for step, complete in checkpoints if step < saved]
    kept_complete = [step for step, complete in older if complete][::-1][: max(0, keep_last - 1)]
    return sorted(step for step, _ in older if step not in kept_complete)

"""Where each process of an RL run reads and writes under `<output_dir>` (one place, so they agree)."""

import re
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rollouts_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "rollouts"


def trainer_checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def orchestrator_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "orchestrator"


def trainer_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "trainer"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`step_<n>` directories under root (complete ones: staging names never match), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    )


def latest_step(root: Path) -> int | None:
    found = step_dirs(root)
    return found[-1][0] if found else None

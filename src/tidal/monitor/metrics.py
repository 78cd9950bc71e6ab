"""Metrics sink: one JSON object per line in metrics.jsonl, mirrored to W&B when enabled."""

import json
import math
import os
from pathlib import Path
from typing import Any

from tidal.config.common import WandbConfig
from tidal.errors import UserError


class MetricsLogger:
    """Appends `{"step": n, ...}` records; on resume, records past the resumed step are dropped first so the
    file never holds two different histories for one step."""

    def __init__(
        self, path: Path, wandb_config: WandbConfig | None = None, run_config: dict[str, Any] | None = None
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wandb = _init_wandb(wandb_config, self.path.parent, run_config) if wandb_config else None

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= step]
        # a new file renamed over the old one: a reader following the old file never sees it shrink mid-line
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _step_of(line: str) -> float:
    """The step of one record; a line a killed writer left half-written counts as past every step."""
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the information as a string
    return value


def _init_wandb(config: WandbConfig, output_dir: Path, run_config: dict[str, Any] | None) -> Any:
    if not config.enabled:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError(
            "wandb.enabled = true but the `wandb` package is not installed (pip install 'tidal[wandb]')"
        ) from None
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=config.project,
        name=config.name or output_dir.name,
        mode=config.mode,
        dir=str(output_dir),
        config=run_config or {},
    )

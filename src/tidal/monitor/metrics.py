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


class MetricsTail:
    """Follows a metrics.jsonl as its writer appends: `new_records()` returns the records added since the
    last call, starting at the file's end when the tail is made (what was there is history).

    A resumed writer rewrites the file without the steps it will redo (a new file under the same name) and
    goes on appending: the tail then skips the lines it has read before (the kept history) and returns the
    rest, redone steps included. A line it cannot parse is skipped, and a line not ended yet is read once
    it is.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._inode, self._offset = _file_identity(self.path)
        self._seen: set[int] = set()
        """Hashes of the lines read so far: after a rewrite, those are history."""
        if self._inode is not None:
            self._seen = {hash(line) for line in self._read(0).splitlines()}

    def new_records(self) -> list[dict[str, Any]]:
        current = _file_identity(self.path)
        if current[0] is None:
            return []
        rewritten = current[0] != self._inode or current[1] < self._offset
        if rewritten:
            self._inode, self._offset = current[0], 0
        lines = self._read(self._offset).splitlines()
        if rewritten:
            while lines and hash(lines[0]) in self._seen:
                lines.pop(0)
        self._seen.update(hash(line) for line in lines)
        return [r for r in map(_parse_record, (b.decode(errors="replace") for b in lines)) if r is not None]

    def _read(self, offset: int) -> bytes:
        """The complete lines from `offset` on; moves the offset past them."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return b""
        complete = data[: data.rfind(b"\n") + 1]
        self._offset = offset + len(complete)
        return complete


def _file_identity(path: Path) -> tuple[int | None, int]:
    """(inode, size) of a file, (None, 0) while it does not exist."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None, 0
    return stat.st_ino, stat.st_size


def _parse_record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


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

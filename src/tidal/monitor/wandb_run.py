"""One W&B run per `tidal rl`, written by the launcher alone from the files the run's processes write.

Trainer and orchestrator are separate processes, possibly on other nodes, and either may be restarted: none
of them owns the W&B run. The launcher on the orchestrator's node follows trainer/metrics.jsonl,
orchestrator/metrics.jsonl and samples.jsonl (tidal.monitor.metrics.MetricsTail, which follows a resumed
writer's rewrite) and logs each step once both sides have it, in step order, as W&B wants its steps. The run's
id is kept in the output dir: `tidal rl --resume` continues the same run rather than starting another.
"""

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal import run_layout
from tidal.config.common import WandbConfig
from tidal.errors import UserError

TOP_LEVEL_PREFIXES = ("eval/",)
"""Orchestrator keys logged under their own name (their own W&B section), not under `orchestrator/`."""

SAMPLE_COLUMNS = ("step", "env", "task_id", "prompt", "completion", "reward", "policy_version")


def orchestrator_key(key: str) -> str:
    return key if key.startswith(TOP_LEVEL_PREFIXES) else f"orchestrator/{key}"


def as_number(value: Any) -> Any:
    """metrics.jsonl writes NaN and inf as strings (JSON has neither): the numbers again, for the charts."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


@dataclass
class StepLog:
    """One W&B step: trainer and orchestrator metrics under their role's prefix, and the step's samples."""

    step: int
    metrics: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)


class StepMerger:
    """Joins the records of one step from both processes and hands the steps out in order, each once (pure).

    The orchestrator logs step n before the trainer can train on it, so a step is complete when the trainer's
    record arrives. A step the run does again after a restart was logged already: W&B keeps its first values
    (metrics.jsonl holds the redo)."""

    def __init__(self, last_logged: int = -1):
        self.last_logged = last_logged
        self._orchestrator: dict[int, dict[str, Any]] = {}
        self._samples: dict[int, list[dict[str, Any]]] = {}

    def add_orchestrator(self, record: dict[str, Any]) -> None:
        if record["step"] > self.last_logged:
            self._orchestrator[record["step"]] = record
            self._samples.pop(record["step"], None)  # a redone step's samples come again after it

    def add_sample(self, record: dict[str, Any]) -> None:
        if record["step"] > self.last_logged:
            self._samples.setdefault(record["step"], []).append(record)

    def add_trainer(self, record: dict[str, Any]) -> list[StepLog]:
        """The steps complete with this trainer record: earlier ones only the orchestrator logged, then its."""
        step = record["step"]
        if step <= self.last_logged:
            return []
        ready = [self._take(s) for s in sorted(s for s in self._orchestrator if s < step)]
        merged = self._take(step)
        merged.metrics.update({f"trainer/{k}": as_number(v) for k, v in record.items() if k != "step"})
        return [*ready, merged]

    def flush(self) -> list[StepLog]:
        """At the end: the steps the orchestrator logged that no trainer record completed."""
        return [self._take(s) for s in sorted(s for s in self._orchestrator if s > self.last_logged)]

    def _take(self, step: int) -> StepLog:
        record = self._orchestrator.pop(step, {})
        metrics = {orchestrator_key(k): as_number(v) for k, v in record.items() if k != "step"}
        self.last_logged = max(self.last_logged, step)
        return StepLog(step, metrics, self._samples.pop(step, []))


def sample_rows(samples: list[dict[str, Any]]) -> tuple[list[str | int], list[list[Any]]]:
    """Columns and rows of the W&B samples table: the fixed columns, then one per reward metric (`metric/…`)
    any sample of the step has."""
    metric_keys = sorted({k for s in samples for k in s.get("metrics", {})})
    columns: list[str | int] = [*SAMPLE_COLUMNS, *(f"metric/{k}" for k in metric_keys)]
    rows = [
        [s.get(c) for c in SAMPLE_COLUMNS] + [s.get("metrics", {}).get(k) for k in metric_keys]
        for s in samples
    ]
    return columns, rows


class WandbRun:
    """The run's W&B run. <output_dir>/wandb/tidal_run.json keeps its id and the last step logged: a resumed
    `tidal rl` reopens the same run (online or offline: `wandb sync` joins the offline parts) and does not
    log a step twice."""

    def __init__(self, config: WandbConfig, output_dir: Path, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError(
                "wandb.enabled = true but the `wandb` package is not installed (pip install 'tidal[wandb]')"
            ) from None
        self._wandb = wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        self._state_file = run_layout.wandb_run_file(output_dir)
        state = json.loads(self._state_file.read_text()) if self._state_file.exists() else {}
        self.run_id: str = state.get("id") or secrets.token_hex(4)
        self.last_step: int = int(state.get("last_step", -1))
        """The last step logged (by this launcher or the one before a resume); -1: none yet."""
        self._save_state()
        try:
            self.run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.name or Path(output_dir).resolve().name,
                group=config.group,
                tags=config.tags or None,
                mode=config.mode,
                dir=str(output_dir),
                id=self.run_id,
                resume="allow",
                config=run_config,
            )
        except Exception as exc:  # no network, no login, a bad entity: W&B's own message, on one line
            message = " ".join(str(exc).split())
            raise UserError(
                f"wandb: could not start the W&B run ({message}); mode = 'offline' needs no server"
            ) from None

    def log(self, entry: StepLog) -> None:
        payload: dict[str, Any] = {k: v for k, v in entry.metrics.items() if _loggable(v)}
        if entry.samples:
            columns, rows = sample_rows(entry.samples)
            payload["samples"] = self._wandb.Table(columns=columns, data=rows)
        self.run.log(payload, step=entry.step)
        self.last_step = max(self.last_step, entry.step)
        self._save_state()

    def finish(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)
        # W&B's service writes the run's file behind finish(): stopping it waits until all is written, so an
        # offline run is complete (ready for `wandb sync`) once `tidal rl` exits
        self._wandb.teardown()

    def _save_state(self) -> None:
        self._state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run_id, "last_step": self.last_step}))
        os.replace(tmp, self._state_file)


def _loggable(value: Any) -> bool:
    return isinstance(value, bool | int | float | str)

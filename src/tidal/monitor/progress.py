"""The launcher's view of a running `tidal rl`: it follows the metrics and samples files the trainer and the
orchestrator write and, per trained step, updates the console, logs the step to W&B and redraws the plot now
and then (`tidal plot`, beside the run)."""

import subprocess
import sys
from pathlib import Path
from typing import Any

from tidal import run_layout
from tidal.monitor.console import Console
from tidal.monitor.metrics import MetricsTail
from tidal.monitor.wandb_run import StepMerger, WandbRun


class StepReporter:
    """Per step the trainer logged: one console step, one W&B step (with the orchestrator's record and the
    step's samples). On `--resume` the files already hold the earlier run's steps: reading starts at their
    current end, and a resumed child's rewrite of its file is followed (MetricsTail). The summary must never
    stop the run it reports on: a line it cannot parse is skipped."""

    def __init__(
        self, output_dir: Path, max_steps: int, console: Console | None = None, wandb: WandbRun | None = None
    ):
        self.console = console or Console(max_steps, "lines")
        self.wandb = wandb
        self._trainer = MetricsTail(run_layout.trainer_dir(output_dir) / "metrics.jsonl")
        self._orchestrator = MetricsTail(run_layout.orchestrator_dir(output_dir) / "metrics.jsonl")
        self._samples = MetricsTail(run_layout.samples_path(output_dir))
        self._orch: dict[int, dict[str, Any]] = {}
        self.merger = StepMerger(wandb.last_step if wandb is not None else -1)

    def poll(self) -> list[int]:
        """Report the steps trained since the last call; returns them."""
        # the trainer first: what the orchestrator wrote for a step (metrics, samples) is on disk before the
        # trainer can train on it, so reading after the trainer finds it
        trained = self._trainer.new_records()
        for record in self._orchestrator.new_records():
            self._orch[record["step"]] = record
            self.merger.add_orchestrator(record)
        for sample in self._samples.new_records():
            self.merger.add_sample(sample)
        for record in trained:
            self.console.step(record["step"], self._orch.get(record["step"], {}), record)
            for entry in self.merger.add_trainer(record):
                if self.wandb is not None:
                    self.wandb.log(entry)
        return [r["step"] for r in trained]

    def close(self, exit_code: int) -> None:
        """The last records, then the W&B run's end (steps only the orchestrator logged included)."""
        self.poll()
        self.console.close()
        if self.wandb is not None:
            for entry in self.merger.flush():
                self.wandb.log(entry)
            self.wandb.finish(exit_code)
            self.wandb = None


class BackgroundPlot:
    """`tidal plot <output_dir>` in a process of its own, one at a time (drawing takes seconds; the launcher
    must go on supervising); its output in logs/plot.log."""

    def __init__(self, output_dir: Path, interval: int | None):
        self.output_dir = Path(output_dir)
        self.interval = interval
        self._process: subprocess.Popen[bytes] | None = None

    def after(self, steps: list[int]) -> None:
        """Redraw when one of the steps just trained completes an `interval`, unless a drawing is still on."""
        if self.interval is None or not any((s + 1) % self.interval == 0 for s in steps):
            return
        if self._process is not None and self._process.poll() is None:
            return
        log = self.output_dir / "logs" / "plot.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tidal", "plot", str(self.output_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def stop(self, grace: float = 15.0) -> None:
        """A drawing still on gets `grace` seconds to finish (on a loaded machine its imports alone take
        seconds, and a drawing killed at every run's end would never be seen), then is killed: the final
        plot is drawn after the run anyway."""
        if self._process is not None and self._process.poll() is None:
            try:
                self._process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

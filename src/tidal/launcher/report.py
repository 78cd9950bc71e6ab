"""What one node of a `tidal rl` run tells about it: its own lines on the console (`tidal rl: ...`,
`tidal node 1 (gpu-b2): ...`); on the orchestrator's node, one console line per trained step, the W&B run
and the plot redrawn beside the run (tidal.monitor.progress); every failure and recovery as a record in
`<output_dir>/events.jsonl`. The supervision and the restarts decide what happened; this says it.
"""

import sys
import time
from typing import TYPE_CHECKING, Any

from tidal.config.rl import RLConfig
from tidal.launcher.children import Failure
from tidal.launcher.restarts import Recovery, how_it_ended
from tidal.monitor.console import Console
from tidal.monitor.events import EventLog
from tidal.monitor.progress import BackgroundPlot, StepReporter

if TYPE_CHECKING:
    from tidal.monitor.wandb_run import WandbRun


class RunReport:
    """The console, the events log, and on the orchestrator's node (`follow_steps`) the steps' summary,
    W&B and the plot. `prefix` starts each of the launcher's own lines."""

    def __init__(self, config: RLConfig, prefix: str, node_label: str | None):
        self.config = config
        self.out = config.output_dir
        self.prefix = prefix
        self.console = Console(config.max_steps, config.monitor.progress)
        self.events = EventLog(self.out, node_label)
        self.plot = BackgroundPlot(self.out, config.monitor.plot_interval)
        self.steps: StepReporter | None = None
        """On the orchestrator's node: the console's steps, the W&B run."""

    def say(self, line: str) -> None:
        self.console.say(f"{self.prefix}: {line}")

    def stopping_on_signal(self, signum: int) -> None:
        print(f"{self.prefix}: signal {signum}: stopping every process", file=sys.stderr)

    def follow_steps(self) -> None:
        """Report the trained steps from now on (and open the W&B run, if one is configured)."""
        self.steps = StepReporter(self.out, self.config.max_steps, self.console, self._open_wandb())

    def _open_wandb(self) -> "WandbRun | None":
        if not self.config.wandb.enabled:
            return None
        from tidal.monitor.wandb_run import WandbRun

        run = WandbRun(self.config.wandb, self.out, self.config.model_dump(mode="json"))
        self.say(f"W&B run {run.run_id} ({self.config.wandb.mode}) in {self.out}/wandb/")
        return run

    def poll(self) -> None:
        """Report the steps trained since the last call; redraw the plot when one completes its interval."""
        if self.steps is not None:
            self.plot.after(self.steps.poll())

    def last_steps(self) -> None:
        """The steps logged before the trainer and the orchestrator ended (no redraw: the final plot follows)."""
        if self.steps is not None:
            self.steps.poll()

    def close(self, code: int) -> None:
        """Stop a drawing still on, then end the W&B run with the run's exit code."""
        self.plot.stop()
        if self.steps is None:
            return
        try:
            self.steps.close(code)
        except Exception as exc:  # W&B failing at the end must not hide how the run ended
            print(f"{self.prefix}: warning: closing the W&B run failed: {exc!r}", file=sys.stderr)

    def failure(self, failure: Failure, action: str, **fields: Any) -> None:
        """One failure record: which role, what ended and how, and what the launcher does (`action`)."""
        self.events.write(
            "failure", at=_wall(failure.when), role=failure.child.name, cause=failure.cause,
            **how_it_ended(failure.code), pid=failure.pid or failure.child.pid, action=action, **fields,
        )  # fmt: skip

    def recovered(self, recovery: Recovery) -> None:
        """A complete recovery: its record, and one line of how long it took."""
        record = recovery.record()
        self.events.write("recovery", **record)
        self.say(
            f"{recovery.role} recovered: back {record['seconds_lost']:.1f} s after it "
            f"failed; step {record['next_step']} trained {record['seconds_to_next_step']:.1f} s after"
        )

    def unfinished(self, recovery: Recovery) -> None:
        """A recovery the run ended before, with what is known of it."""
        self.events.write("recovery", complete=False, **recovery.record())


def _wall(monotonic: float) -> float:
    """time.time() of a time.monotonic() instant."""
    return time.time() - (time.monotonic() - monotonic)

"""What `tidal rl` prints while it runs: timestamped messages, and per step a progress bar (a terminal) or
one plain line (a log file, a batch job), both with step time and ETA.

Steps are numbered as in metrics.jsonl and rollouts/step_<n>, from 0; `[4/10]` beside `step 3` counts the
steps done.
"""

import sys
import time
from collections import deque
from typing import IO, Any, Literal

Mode = Literal["auto", "bar", "lines"]
RECENT_STEPS = 5
"""Step times averaged for the ETA: recent ones, so a slow first step (model loading) soon stops counting."""


def clock(at: float | None = None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def duration(seconds: float | None) -> str:
    """`42 s`, `3:07`, `1:02:03`; `?` when unknown."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepClock:
    """When steps finished (as the console saw them), for the step time and the ETA (pure: times are given)."""

    def __init__(self) -> None:
        self._ends: deque[float] = deque(maxlen=RECENT_STEPS + 1)

    def finished(self, at: float) -> None:
        self._ends.append(at)

    @property
    def last_step_seconds(self) -> float | None:
        return self._ends[-1] - self._ends[-2] if len(self._ends) > 1 else None

    @property
    def mean_step_seconds(self) -> float | None:
        if len(self._ends) < 2:
            return None
        return (self._ends[-1] - self._ends[0]) / (len(self._ends) - 1)

    def eta(self, steps_left: int) -> float | None:
        mean = self.mean_step_seconds
        return None if mean is None else mean * steps_left


def step_summary(orch: dict[str, Any], trainer: dict[str, Any]) -> str:
    """Reward, lag, loss and throughputs of one step, from the orchestrator's and the trainer's records."""
    return (
        f"reward {_num(orch.get('reward/mean')):.3f} | off-policy {orch.get('off_policy/max', '?')}"
        f" | loss {_num(trainer.get('loss')):+.4f}"
        f" | trainer {_num(trainer.get('tokens_per_s'), 0) / 1e3:.1f}k tok/s"
        f" | inference {_num(orch.get('tokens_per_s'), 0):.0f} tok/s"
        f" | trainer waited {_num(trainer.get('time/wait_for_data'), 0):.2f} s"
    )


def step_line(step: int, max_steps: int, clock_: StepClock, summary: str, at: float | None = None) -> str:
    """`12:00:03 step 3 [4/10] | 2.1 s/step | ETA 13 s | reward ...` (pure but for the wall clock)."""
    last = clock_.last_step_seconds
    per_step = f"{last:.1f} s/step" if last is not None else "first step"
    eta = duration(clock_.eta(max_steps - step - 1))
    return f"{clock(at)} step {step} [{step + 1}/{max_steps}] | {per_step} | ETA {eta} | {summary}"


def _num(value: Any, default: float = float("nan")) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


class Console:
    """Prints the launcher's messages with a timestamp, and each finished step as a bar update or a line."""

    def __init__(self, max_steps: int, mode: Mode = "auto", stream: IO[str] | None = None):
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self.use_bar = mode == "bar" or (mode == "auto" and _is_terminal(self.stream))
        self.clock = StepClock()
        self._bar: Any = None

    def say(self, message: str) -> None:
        line = f"{clock()} {message}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def step(self, step: int, orch: dict[str, Any], trainer: dict[str, Any]) -> None:
        self.clock.finished(time.monotonic())
        summary = step_summary(orch, trainer)
        if not self.use_bar:
            print(step_line(step, self.max_steps, self.clock, summary), file=self.stream, flush=True)
            return
        bar = self._open_bar(step)
        bar.n = step + 1
        bar.set_postfix_str(f"step {step} | {summary}", refresh=False)
        bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _open_bar(self, step: int) -> Any:
        if self._bar is None:
            from tqdm import tqdm

            # the bar's rate and ETA start at this step: a resumed run's earlier steps took no time here
            self._bar = tqdm(
                total=self.max_steps, initial=step, unit="step", file=self.stream, dynamic_ncols=True,
                desc="tidal rl", smoothing=0.3,
            )  # fmt: skip
        return self._bar


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())

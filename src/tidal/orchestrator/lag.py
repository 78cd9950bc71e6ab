"""Event-loop lag: how late the orchestrator's asyncio loop wakes a timer, sampled all the time, summed up per step.

Everything the orchestrator does (dispatching requests, reading replies, scoring, packing) shares one event
loop; anything that holds it (a CPU-heavy reward, a big JSON parse) delays every request behind it. A
sleeper task asks to wake every `interval` s and records how much later than that it woke: the lag.

The garbage collector is one such holder: a full collection walks every tracked object, and after startup
that means all of torch, transformers and the task lists, none of which will ever be garbage. `frozen_heap`
takes them out of its walks once setup is done.
"""

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of `values`; NaN for none (pure)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def lag_metrics(samples: Sequence[float]) -> dict[str, float]:
    """The step's lag summary as metrics (seconds); empty when the loop was never sampled."""
    if not samples:
        return {}
    return {
        "event_loop/lag_p50_s": percentile(samples, 50),
        "event_loop/lag_p99_s": percentile(samples, 99),
        "event_loop/lag_max_s": max(samples),
    }


GC_THRESHOLD = (50_000, 20, 100)
"""Young collections every 50,000 net container allocations instead of 700: with thousands of requests in
flight each young collection walks every object of the replies not yet scored, so the default ran them (and
the older generations' walks they trigger) for a fifth of the loop's time."""


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, every object alive at its start is exempt from collections (collected first: what
    is left is startup state that lives on); objects made inside are collected as usual. On the way out they
    are handed back to the collector, so that a process that goes on (a test, a notebook) or shuts down
    (extension modules that check for leaks at exit) sees an ordinary heap."""
    gc.collect()
    gc.freeze()
    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


class LoopLagMonitor:
    """Samples the running loop's wake-up lag every `interval` s until `stop()`; `take()` hands over what
    was sampled since the last `take()`."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self._samples: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._gc_pauses: list[float] = []
        self._asked = math.inf  # when the sleeper should wake next
        self._gc_started = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        gc.callbacks.append(self._on_gc)

    async def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        late = asyncio.get_running_loop().time() - self._asked
        if self._task is not None and late > 0:  # held until now: the sleeper never got to wake
            self._samples.append(late)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def take(self) -> list[float]:
        samples, self._samples = self._samples, []
        return samples

    def take_gc(self) -> dict[str, float]:
        """Garbage-collector pauses since the last call: their total and the longest (seconds), so that a
        lag spike can be told apart from a collection."""
        pauses, self._gc_pauses = self._gc_pauses, []
        return {"event_loop/gc_s": sum(pauses), "event_loop/gc_max_s": max(pauses, default=0.0)}

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_pauses.append(time.perf_counter() - self._gc_started)

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._asked = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self._samples.append(max(0.0, loop.time() - self._asked))

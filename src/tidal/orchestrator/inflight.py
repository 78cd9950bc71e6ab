"""The groups in flight across steps: how many more to start (a pure rule) and the pool that runs them.

A step used to start only the groups it still lacked and to cancel the rest when it had enough, so the
engine ran dry at the tail of every step (the last, longest groups alone) and between steps. Here groups
outlive the step that started them. A group started under policy version `v` may train any step up to
`v + max_async_level`, so while the current policy allows it, groups for the next steps start as soon as
the current step's own groups leave room: the engine stays busy while the trainer trains. A step takes the
groups in the order they started, so what it trains does not depend on which episodes end first. At the
end of a step the groups still running are carried into the next step if it may train them; the others
are cancelled and their tasks run again later with the same seeds (as a synchronous run always did).

With `max_async_level = 0` nothing runs ahead: the rule reduces to "the groups this step still lacks".

A step drops groups without a learning signal (`zero_signal = "drop"`), and a refill used to start only
once a dropped group had ended: each round of drops added a whole group's latency (every turn of a
multi-turn episode) to the step while the engine ran a handful of requests. The rule now starts, with the
step, the groups it expects to need at the share of groups recent steps kept (`KeepRate`).
"""

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tidal.orchestrator.advantages import stale
from tidal.types import Group


@dataclass(frozen=True)
class LaunchRule:
    """How many groups to start now (pure). All counts are groups, not requests."""

    num_prompts: int
    """Groups a step trains on."""
    max_in_flight: int | None
    """Groups running at once, whichever step they are for (None: no cap beyond the demand below, which
    the async bound and the keep rate's floor already bound)."""
    max_async_level: int
    """A group started under policy `v` may train steps up to `v + max_async_level`."""
    limit: int
    """New tasks a step may draw for its own groups (refills of dropped groups included)."""
    last_step: int | None = None
    """The run's last step (max_steps − 1): nothing starts for a step past it (None: no end)."""
    max_off_policy_steps: int | None = None
    """How many versions old a group may be when a step trains it (None: `max_async_level`): what decides
    whether a group still running at the end of a step carries into the next. Starting groups ahead still
    looks `max_async_level` steps ahead."""

    def steps_ahead(self, step: int, version: int) -> int:
        """Later steps, after `step`, that a group started now under `version` may still train."""
        reach = version + self.max_async_level
        if self.last_step is not None:
            reach = min(reach, self.last_step)
        return max(0, reach - step)

    def room(
        self,
        step: int,
        version: int,
        kept: int,
        in_flight: int,
        drawn: int,
        waiting: int = 0,
        keep_rate: float = 1.0,
    ) -> int:
        """Groups to start now, while `step` has `kept` groups, `in_flight` run, `waiting` ended and wait for
        their turn, `drawn` tasks were started during the step, and a group is kept with odds `keep_rate`.

        Demand is what the current step still lacks plus a whole step for each later step a group started
        now may train, divided by the keep rate; groups running or waiting count against it. Draws during a
        step are bounded by its own refill budget plus that look-ahead, so a run whose every group is
        dropped still stops."""
        ahead = self.num_prompts * self.steps_ahead(step, version)
        wanted = self.num_prompts - kept + ahead  # groups with a learning signal still to find
        demand = math.ceil(wanted / keep_rate - 1e-9) - in_flight - waiting
        budget = self.limit + ahead - drawn
        room = min(demand, budget)
        if self.max_in_flight is not None:
            room = min(room, self.max_in_flight - in_flight)
        return max(0, room)

    def may_carry(self, launched: int, next_step: int) -> bool:
        """Whether a group started under policy `launched` may still train `next_step`."""
        bound = self.max_async_level if self.max_off_policy_steps is None else self.max_off_policy_steps
        return not stale(launched, next_step, bound)


@dataclass
class KeepRate:
    """The share of the groups a step took that it kept, over the last `window` steps (pure).

    1.0 until a step has been seen (a fresh or resumed run starts as before), and never below `floor`: a
    run where nearly every group is dropped must not start many times the groups a step trains at once."""

    window: int = 4
    floor: float = 0.25
    _steps: deque[tuple[int, int]] = field(default_factory=deque)

    def observe(self, kept: int, taken: int) -> None:
        """A step kept `kept` of the `taken` groups it took (ended and looked at, dropped ones included)."""
        if taken <= 0:
            return
        self._steps.append((kept, taken))
        while len(self._steps) > self.window:
            self._steps.popleft()

    @property
    def value(self) -> float:
        taken = sum(t for _, t in self._steps)
        if not taken:
            return 1.0
        return min(1.0, max(self.floor, sum(k for k, _ in self._steps) / taken))


@dataclass
class _Running:
    order: int
    """Start order: a step trains groups in the order they started, whichever ends first."""
    position: int
    """The task's position in the stream (what a resumed run starts again)."""
    launched: int
    """The policy version inference served when the group started."""


class GroupPool:
    """The groups started and not yet trained on: running, or ended and waiting for their turn.

    Groups are handed out in the order they started (`pop_ready`), not the order they end: with groups for
    later steps running beside the current step's, short episodes end first, and a step filled by whatever
    ended first would train on the short ones and leave the long ones (a multi-turn environment of a mix)
    to later steps. In start order a step trains the groups it would have trained had it run alone.

    Groups queue themselves as they end: waiting costs the same with 10 or 10,000 groups in flight, where
    asyncio.wait over all of them would (un)register a callback on every one per wake-up."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[Group], _Running] = {}  # in start order
        self._finished: dict[int, Group] = {}
        self._ended: asyncio.Queue[asyncio.Task[Group]] = asyncio.Queue()
        self._next_order = 0

    def __len__(self) -> int:
        return len(self._running) + len(self._finished)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def positions(self) -> list[int]:
        """Task positions of the groups running, in start order: what a run resumed now must start again."""
        return [running.position for running in self._running.values()]

    def finished_groups(self) -> list[Group]:
        """The groups that ended and wait for their turn, in start order (what a saved state keeps)."""
        return [self._finished[order] for order in sorted(self._finished)]

    def start(self, position: int, launched: int, work: Awaitable[Group]) -> None:
        task = asyncio.ensure_future(work)
        task.add_done_callback(self._ended.put_nowait)
        self._running[task] = _Running(self._take_order(), position, launched)

    def add_finished(self, groups: list[Group]) -> None:
        """Groups that ended before (a restored state's), in their start order, ahead of any started later."""
        for group in groups:
            self._finished[self._take_order()] = group

    def pop_ready(self) -> Group | None:
        """The oldest group not yet handed out, if it has ended (None while it runs, or with none left)."""
        if not self._finished:
            return None
        oldest = min(self._finished)
        if self._running and next(iter(self._running.values())).order < oldest:
            return None
        return self._finished.pop(oldest)

    async def wait(self, woken: Callable[[], Awaitable[object]] | None = None) -> int:
        """Wait for running groups to end; returns how many did. `woken` (e.g. a new policy version) ends
        the wait early, so the caller can start the groups a newer policy allows."""
        if self._ended.empty() and woken is not None:
            waiting = asyncio.ensure_future(self._ended.get())
            waking = asyncio.ensure_future(woken())
            await asyncio.wait({waiting, waking}, return_when=asyncio.FIRST_COMPLETED)
            waking.cancel()
            if not waiting.done():
                waiting.cancel()
                return 0
            self._ended.put_nowait(waiting.result())
        done = [await self._ended.get()]
        while not self._ended.empty():
            done.append(self._ended.get_nowait())
        ended = 0
        for task in done:
            running = self._running.pop(task, None)
            if running is None:  # cancelled at a step's end, queued itself later: no longer ours
                continue
            self._finished[running.order] = task.result()  # a group's own error (e.g. inference lost) raises
            ended += 1
        return ended

    def carry_into(self, next_step: int, rule: LaunchRule) -> list[int]:
        """Cancel the running groups `next_step` may not train; returns their task positions, in start order."""
        dropped = [task for task, run in self._running.items() if not rule.may_carry(run.launched, next_step)]
        return [self._cancel(task) for task in dropped]

    def cancel_all(self) -> list[int]:
        return [self._cancel(task) for task in list(self._running)]

    def _cancel(self, task: asyncio.Task[Group]) -> int:
        task.cancel()
        return self._running.pop(task).position

    def _take_order(self) -> int:
        self._next_order += 1
        return self._next_order - 1

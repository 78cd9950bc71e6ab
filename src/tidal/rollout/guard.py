"""One rollout's guard: a timeout and the failure accounting that RL and evaluation share.

An environment's exception, or its running past the timeout, fails that rollout only; the caller records
the failure its own way (a failed `Rollout` in a group, a failed record in an eval). Inference being
unreachable is not the environment's failure: it is raised, and stops the run instead.
"""

import asyncio
from collections.abc import Awaitable, Callable

from tidal.envs.base import Environment, Episode, is_async_reward, reward_runner
from tidal.inference.errors import is_infrastructure_error


async def run_alone(work: Callable[[], Awaitable[Episode]], timeout: float | None) -> Episode | Exception:
    """The episode `work()` makes, or the exception that failed it (a timeout is a `TimeoutError`).

    `work` is a factory started here, so a rollout cancelled before it runs leaves no coroutine that was
    never awaited; `asyncio.timeout` rather than `wait_for` adds no task per rollout, and with `timeout`
    None no timer either.
    """
    try:
        async with asyncio.timeout(timeout):
            return await work()
    except (TimeoutError, Exception) as exc:  # noqa: BLE001 - environment code may raise anything
        if is_infrastructure_error(exc):
            raise
        return exc


def scores_inline(env: Environment) -> bool:
    """Whether scoring an episode of `env` never waits: the base `score`, plain reward functions and no
    reward workers. Its rewards then compute on the loop one after another however they are awaited, so a
    caller may score episodes in turn, without a task and a timer each (nothing a timeout could interrupt:
    it fires only at an await)."""
    return (
        type(env).score is Environment.score
        and reward_runner() is None
        and not any(is_async_reward(fn) for fn, _ in env.rewards)
    )

"""Run one group: `group_size` episodes of one task through the environment, each with its own seed.

The sampler handed to the environment fixes everything the loss depends on (temperature, top_p = 1,
top_k off), keeps a multi-turn episode on one server (session affinity, prefix cache) and records the
policy versions that produced its tokens. An exception or a timeout fails that rollout only.
"""

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tidal.config.rl import SamplingConfig
from tidal.envs.base import (
    Environment,
    Episode,
    SingleTurnEnv,
    Task,
    is_async_reward,
    reward_runner,
    run_episode,
    score_episode,
)
from tidal.envs.mix import EnvMix, env_name
from tidal.inference.client import InferenceClient, is_infrastructure_error
from tidal.inference.sampler import ClientSampler
from tidal.types import Group, Rollout

logger = logging.getLogger(__name__)

REPLICAS_METRIC = "inference/replicas"
"""Rollout metric: how many inference replicas served its turns (1 unless one left rotation mid-episode)."""


def rollout_seed(run_seed: int, position: int, index: int) -> int:
    """A per-rollout sampling seed: a rerun (or a resumed run) samples the same tokens for the same task."""
    digest = hashlib.sha256(f"{run_seed}/{position}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF


def rollout_id(position: int, index: int) -> str:
    """Names a rollout by what its sampling seed is made of (`rollout_seed`, the run's seed aside)."""
    return f"{position}/{index}"


async def run_group(
    client: InferenceClient,
    env: Environment,
    tokenizer: Any,
    task: Task,
    position: int,
    group_size: int,
    sampling: SamplingConfig,
    run_seed: int,
    timeout: float,
) -> Group:
    member = (
        env.env_of(task) if isinstance(env, EnvMix) else env
    )  # a mixed single-turn env keeps its n-sample path
    if isinstance(member, SingleTurnEnv):
        return await _single_turn_group(
            client, member, tokenizer, task, position, group_size, sampling, run_seed, timeout
        )

    async def one(index: int) -> Rollout:
        seed = rollout_seed(run_seed, position, index)
        sampler = ClientSampler(
            client, tokenizer, sampling.temperature, sampling.max_tokens, seed, f"{task.task_id}#{index}"
        )
        try:
            rollout = await _fails_alone(
                functools.partial(run_episode, env, task, sampler), env, task, sampler.versions, timeout
            )
        finally:
            client.end_session(sampler.session_id)
        rollout.metrics[REPLICAS_METRIC] = float(len(set(sampler.servers)))
        rollout.rollout_id = rollout_id(position, index)
        return rollout

    rollouts = await asyncio.gather(*(one(i) for i in range(group_size)))
    return Group(task_id=task.task_id, env=env_name(env, task), rollouts=list(rollouts))


async def _single_turn_group(
    client: InferenceClient,
    env: SingleTurnEnv,
    tokenizer: Any,
    task: Task,
    position: int,
    group_size: int,
    sampling: SamplingConfig,
    run_seed: int,
    timeout: float,
) -> Group:
    """One n-sample request for the whole group, then each episode scored on its own (failures stay local)."""
    seed = rollout_seed(run_seed, position, 0)
    sampler = ClientSampler(client, tokenizer, sampling.temperature, sampling.max_tokens, seed, task.task_id)
    try:
        episodes = await env.rollout_group(task, sampler, group_size)
    except Exception as exc:  # noqa: BLE001 - e.g. a prompt the environment cannot render
        error = _failure_name(exc, task)
        failed = [failed_rollout(env, task, sampler.versions, error) for _ in range(group_size)]
        return Group(task_id=task.task_id, env=env_name(env, task), rollouts=_named(failed, position))
    finally:
        client.end_session(sampler.session_id)

    def scoring(episode: Episode, timeout: float | None) -> Awaitable[Rollout]:
        work = functools.partial(score_episode, env, task, episode)
        return _fails_alone(work, env, task, sampler.versions, timeout)

    if scores_inline(env):
        # Nothing to overlap, and nothing a timeout could interrupt (it fires only at an await): one episode
        # after another, without a task and a timer each, which at thousands of rollouts/s cost the loop.
        rollouts = [await scoring(e, None) for e in episodes]
    else:
        rollouts = await asyncio.gather(*(scoring(e, timeout) for e in episodes))
    return Group(task_id=task.task_id, env=env_name(env, task), rollouts=_named(list(rollouts), position))


def _named(rollouts: list[Rollout], position: int) -> list[Rollout]:
    for index, rollout in enumerate(rollouts):
        rollout.rollout_id = rollout_id(position, index)
    return rollouts


def scores_inline(env: Environment) -> bool:
    """Whether scoring an episode of `env` never waits: the base `score`, plain reward functions and no
    reward workers. Its rewards then compute on the loop one after another however they are awaited."""
    return (
        type(env).score is Environment.score
        and reward_runner() is None
        and not any(is_async_reward(fn) for fn, _ in env.rewards)
    )


async def _fails_alone(
    work: Callable[[], Awaitable[Episode]],
    env: Environment,
    task: Task,
    versions: list[int],
    timeout: float | None,
) -> Rollout:
    """The rollout of `work()`; an environment exception or a timeout fails this rollout only (counted).
    `work` is started here, so a rollout cancelled before it runs leaves no coroutine never awaited.

    Inference being unreachable is not the environment's failure: that stops the run instead.
    """
    try:
        async with asyncio.timeout(timeout):  # unlike wait_for, no extra task per rollout
            episode = await work()
        return to_rollout(env, task, episode, versions)
    except (TimeoutError, Exception) as exc:  # noqa: BLE001 - environment code may raise anything
        return failed_rollout(env, task, versions, _failure_name(exc, task))


def _failure_name(exc: BaseException, task: Task) -> str:
    """Log an environment failure of `task` and name it; an infrastructure error is raised again instead."""
    if is_infrastructure_error(exc):
        raise exc
    logger.warning("rollout of %s failed: %s: %s", task.task_id, type(exc).__name__, exc)
    return type(exc).__name__


def to_rollout(env: Environment, task: Task, episode: Episode, versions: list[int]) -> Rollout:
    return Rollout(
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids,
        completion_logprobs=episode.completion_logprobs,
        completion_mask=episode.completion_mask,
        reward=episode.reward,
        policy_version=min(versions, default=0),
        policy_version_max=max(versions, default=0),
        env=env_name(env, task),
        task_id=task.task_id,
        metrics=episode.summary_metrics(),
    )


def failed_rollout(env: Environment, task: Task, versions: list[int], error: str) -> Rollout:
    version = min(versions, default=0)
    return Rollout(
        prompt_ids=[],
        completion_ids=[],
        completion_logprobs=[],
        completion_mask=[],
        reward=0.0,
        policy_version=version,
        policy_version_max=max(versions, default=version),
        env=env_name(env, task),
        task_id=task.task_id,
        metrics={f"error/{error}": 1.0},
        failed=True,
    )

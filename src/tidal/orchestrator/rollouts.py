"""Run one group: `group_size` episodes of one task through the environment, each with its own seed.

The sampler handed to the environment fixes everything the loss depends on (temperature, top_p = 1,
top_k off), keeps a multi-turn episode on one server (session affinity, prefix cache) and records the
policy versions that produced its tokens. An exception or a timeout fails that rollout only.
"""

import asyncio
import hashlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from tidal.config.rl import SamplingConfig
from tidal.envs.base import Environment, Episode, SingleTurnEnv, Task, run_episode
from tidal.envs.mix import EnvMix, env_name
from tidal.inference.client import InferenceClient, NoHealthyServer, ServerFailed
from tidal.inference.sampler import ClientSampler
from tidal.types import Group, Rollout

logger = logging.getLogger(__name__)
T = TypeVar("T")


def rollout_seed(run_seed: int, position: int, index: int) -> int:
    """A per-rollout sampling seed: a rerun (or a resumed run) samples the same tokens for the same task."""
    digest = hashlib.sha256(f"{run_seed}/{position}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF


async def guarded(work: Awaitable[T], timeout: float) -> tuple[T | None, Exception | None]:
    """Await environment work under a timeout. Its own failures (any exception, the timeout) come back as the
    error so they fail one rollout; inference being unreachable raises, because that must stop the run."""
    try:
        return await asyncio.wait_for(work, timeout), None
    except (NoHealthyServer, ServerFailed):
        raise
    except Exception as exc:  # noqa: BLE001 - environment code may raise anything; TimeoutError included
        logger.warning("rollout failed: %s: %s", type(exc).__name__, exc)
        return None, exc


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
    def sampler(index: int, session_id: str) -> ClientSampler:
        seed = rollout_seed(run_seed, position, index)
        return ClientSampler(client, tokenizer, sampling.temperature, sampling.max_tokens, seed, session_id)

    member = env.env_of(task) if isinstance(env, EnvMix) else env
    if isinstance(member, SingleTurnEnv):  # a mixed single-turn env keeps its n-sample path too
        rollouts = await _single_turn_group(member, task, sampler(0, task.task_id), group_size, timeout)
    else:
        rollouts = await asyncio.gather(
            *(_episode(env, task, sampler(i, f"{task.task_id}#{i}"), timeout) for i in range(group_size))
        )
    return Group(task_id=task.task_id, env=env_name(env, task), rollouts=list(rollouts))


async def _episode(env: Environment, task: Task, sampler: ClientSampler, timeout: float) -> Rollout:
    try:
        episode, error = await guarded(run_episode(env, task, sampler), timeout)
    finally:
        sampler.client.end_session(sampler.session_id)
    return _as_rollout(env, task, episode, error, sampler.versions)


async def _single_turn_group(
    env: SingleTurnEnv, task: Task, sampler: ClientSampler, group_size: int, timeout: float
) -> list[Rollout]:
    """One n-sample request for the whole group, then each episode scored on its own (failures stay local)."""
    episodes = await env.rollout_group(task, sampler, group_size)
    sampler.client.end_session(sampler.session_id)

    async def score(episode: Episode) -> Rollout:
        _, error = await guarded(env.score(task, episode), timeout)
        return _as_rollout(env, task, episode, error, sampler.versions)

    return list(await asyncio.gather(*(score(e) for e in episodes)))


def _as_rollout(
    env: Environment, task: Task, episode: Episode | None, error: Exception | None, versions: list[int]
) -> Rollout:
    if episode is None or error is not None:
        return failed_rollout(env, task, versions, type(error).__name__)
    return to_rollout(env, task, episode, versions)


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

"""Run one group: `group_size` episodes of one task through the environment's group strategy, as `Rollout`s.

The sampler handed to the environment fixes everything the loss depends on (temperature, top_p = 1,
top_k off), keeps a multi-turn episode on one server (session affinity, prefix cache) and records the
policy versions that produced its tokens. An exception or a timeout fails that rollout only
(`tidal.rollout.guard`).
"""

import asyncio
import functools
import logging
from collections.abc import Awaitable
from typing import Any

from tidal.config.rl import SamplingConfig
from tidal.envs.base import Environment, Episode, EpisodeWork, Task, score_episode
from tidal.envs.mix import env_name
from tidal.inference.errors import is_infrastructure_error
from tidal.inference.generation import GenerationClient
from tidal.models.vision import check_reply, picture_token_ids
from tidal.rollout.guard import run_alone, scores_inline
from tidal.rollout.sampler import ClientSampler, rollout_id, rollout_seed
from tidal.types import Group, Rollout

logger = logging.getLogger(__name__)

REPLICAS_METRIC = "inference/replicas"
"""Rollout metric: how many inference replicas served its turns (1 unless one left rotation mid-episode)."""


async def run_group(
    client: GenerationClient,
    env: Environment,
    tokenizer: Any,
    task: Task,
    position: int,
    group_size: int,
    sampling: SamplingConfig,
    run_seed: int,
    timeout: float,
) -> Group:
    """The environment plans the group (`rollout_group`: one request, or a work per rollout); each rollout
    is then sampled (a work, under `timeout`) and scored on its own, so failures stay local."""
    member = env.env_of(task)  # a mix's member: whose scoring decides `scores_inline`
    sampler = ClientSampler(
        client,
        tokenizer,
        sampling.temperature,
        sampling.max_tokens,
        rollout_seed(run_seed, position, 0),
        task.task_id,
        fork_seed=functools.partial(rollout_seed, run_seed, position),
    )
    try:
        try:
            planned = await member.rollout_group(task, sampler, group_size)
            if len(planned) != group_size:
                raise ValueError(
                    f"rollout_group returned {len(planned)} rollouts for a group of {group_size}"
                )
        except Exception as exc:  # noqa: BLE001 - e.g. a prompt the environment cannot render
            error = _failure_name(exc, task)
            failed = [failed_rollout(env, task, sampler.versions, error) for _ in range(group_size)]
            return Group(task_id=task.task_id, env=env_name(env, task), rollouts=_named(failed, position))
        rollouts = await _settle(env, member, task, sampler, planned, timeout)
    finally:
        sampler.end_sessions()
    return Group(task_id=task.task_id, env=env_name(env, task), rollouts=_named(rollouts, position))


async def _settle(
    env: Environment,
    member: Environment,
    task: Task,
    sampler: ClientSampler,
    planned: list[Episode | EpisodeWork],
    timeout: float,
) -> list[Rollout]:
    """Every planned rollout sampled (works, concurrently) and scored, each failing alone; one whose turns
    after a prompt with pictures hold a picture token (`picture_token_ids`) fails."""

    async def checked(episode: Episode) -> Episode:
        if episode.images:  # the model's turns: only the environment's turns may add a picture
            written = [t for t, m in zip(episode.completion_ids, episode.completion_mask, strict=True) if m]
            check_reply(written, _picture_ids(sampler.tokenizer))
        return await score_episode(member, task, episode)

    def scoring(episode: Episode, timeout: float | None) -> Awaitable[Rollout]:
        return _fails_alone(functools.partial(checked, episode), env, task, sampler.versions, timeout)

    async def sampling(index: int, work: EpisodeWork) -> Rollout:
        async def episode() -> Episode:
            return await checked(await work())

        fork = sampler.forks.get(index)
        try:
            rollout = await _fails_alone(episode, env, task, (fork or sampler).versions, timeout)
        finally:
            if fork is not None:  # released as soon as its episode ends, not with the group
                sampler.client.end_session(fork.session_id)
        if fork is not None:
            rollout.metrics[REPLICAS_METRIC] = float(len(set(fork.servers)))
        return rollout

    if all(isinstance(p, Episode) for p in planned) and scores_inline(member):
        # Nothing to overlap, and nothing a timeout could interrupt (it fires only at an await): one episode
        # after another, without a task and a timer each, which at thousands of rollouts/s cost the loop.
        return [await scoring(p, None) for p in planned if isinstance(p, Episode)]
    return list(
        await asyncio.gather(
            *(
                scoring(p, timeout) if isinstance(p, Episode) else sampling(i, p)
                for i, p in enumerate(planned)
            )
        )
    )


_PICTURE_IDS: dict[int, frozenset[int]] = {}
"""Picture token ids by tokenizer (its id(): the run's one tokenizer lives as long as the process), read once
and only for rollouts with pictures: a text run never walks its vocabulary."""


def _picture_ids(tokenizer: Any) -> frozenset[int]:
    key = id(tokenizer)
    if key not in _PICTURE_IDS:
        _PICTURE_IDS[key] = picture_token_ids(tokenizer)
    return _PICTURE_IDS[key]


def _named(rollouts: list[Rollout], position: int) -> list[Rollout]:
    for index, rollout in enumerate(rollouts):
        rollout.rollout_id = rollout_id(position, index)
    return rollouts


async def _fails_alone(
    work: EpisodeWork, env: Environment, task: Task, versions: list[int], timeout: float | None
) -> Rollout:
    """The rollout of `work()`, or a failed one (counted) when the environment raised or timed out."""
    outcome = await run_alone(work, timeout)
    if isinstance(outcome, Episode):
        return to_rollout(env, task, outcome, versions)
    return failed_rollout(env, task, versions, _failure_name(outcome, task))


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
        routed_experts=episode.routed_experts,
        images=list(episode.images),
        policy_versions=list(versions),
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
        policy_versions=list(versions),
    )

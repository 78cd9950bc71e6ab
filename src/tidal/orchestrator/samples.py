"""Rollouts kept as text for people to read (<output_dir>/samples.jsonl, the W&B `samples` table): which ones,
and the record of each (pure; the tokenizer's decode is passed in)."""

from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any

from tidal.types import Group, Rollout


def is_sample_step(step: int, interval: int | None) -> bool:
    return interval is not None and step % interval == 0


def pick_rollouts(groups: Sequence[Group], num: int) -> list[Rollout]:
    """Up to `num` rollouts across the groups: the first of each group, then the second of each, ...; so a
    few samples show several tasks, not one task's group."""
    rounds = zip_longest(*(g.rollouts for g in groups))
    picked = [r for round_ in rounds for r in round_ if r is not None]
    return picked[:num]


def sample_record(rollout: Rollout, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """What one sample shows: prompt and completion as text, reward and the environment's reward metrics,
    the policy versions that produced it."""
    return {
        "env": rollout.env,
        "task_id": rollout.task_id,
        "rollout_id": rollout.rollout_id,
        "prompt": decode(rollout.prompt_ids),
        "completion": decode(rollout.completion_ids),
        "reward": rollout.reward,
        "policy_version": rollout.policy_version,
        "policy_version_max": rollout.policy_version_max,
        "policy_versions": list(rollout.policy_versions),
        "completion_tokens": len(rollout.completion_ids),
        "metrics": dict(rollout.metrics),
    }

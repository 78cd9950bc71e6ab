"""Advantages, zero-signal filtering and staleness bookkeeping against hand-computed values."""

import math

import pytest

from tidal.orchestrator.advantages import (
    StalenessTracker,
    compute_advantages,
    filter_groups,
    is_zero_signal,
    split_stale,
    stale,
)
from tidal.types import Group, Rollout


def rollout(reward: float, version: int = 0, failed: bool = False, task_id: str = "t") -> Rollout:
    return Rollout(
        prompt_ids=[1, 2],
        completion_ids=[3],
        completion_logprobs=[-0.5],
        completion_mask=[1],
        reward=reward,
        policy_version=version,
        policy_version_max=version,
        env="test",
        task_id=task_id,
        failed=failed,
    )


def group(*rewards: float, version: int = 0, task_id: str = "t") -> Group:
    return Group(task_id, "test", [rollout(r, version, task_id=task_id) for r in rewards])


def test_mean_advantages():
    assert compute_advantages([1.0, 0.0, 0.0, 1.0], "mean") == [0.5, -0.5, -0.5, 0.5]
    assert compute_advantages([3.0, 1.0, 2.0], "mean") == [1.0, -1.0, 0.0]


def test_std_advantages_use_population_std():
    # centred ±0.5, population std 0.5 (the sample std would be 0.577)
    assert compute_advantages([1.0, 0.0, 0.0, 1.0], "std", eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    # centred [1, -1, 0], std sqrt(2/3)
    got = compute_advantages([3.0, 1.0, 2.0], "std", eps=0.0)
    assert got == pytest.approx([math.sqrt(1.5), -math.sqrt(1.5), 0.0])
    got = compute_advantages([1.0, 0.0], "std", eps=0.5)  # centred ±0.5, std 0.5 → 0.5 / 1.0
    assert got == pytest.approx([0.5, -0.5])


def test_std_advantages_of_equal_rewards_are_zero_not_nan():
    assert compute_advantages([2.0, 2.0, 2.0], "std") == [0.0, 0.0, 0.0]


def test_rloo_is_reward_minus_mean_of_the_others():
    # 3 − mean(1, 2) = 1.5; 1 − mean(3, 2) = −1.5; 2 − mean(3, 1) = 0
    assert compute_advantages([3.0, 1.0, 2.0], "rloo") == pytest.approx([1.5, -1.5, 0.0])
    assert compute_advantages([1.0, 0.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("kind", ["mean", "std", "rloo"])
def test_groups_of_one_or_none_have_no_baseline(kind):
    assert compute_advantages([5.0], kind) == [0.0]
    assert compute_advantages([], kind) == []


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="advantage kind"):
        compute_advantages([1.0, 0.0], "median")  # type: ignore[arg-type]


def test_is_zero_signal():
    assert is_zero_signal([0.0, 0.0])
    assert is_zero_signal([])
    assert is_zero_signal([1e-9, -1e-9], tol=1e-8)
    assert not is_zero_signal([0.0, 1e-3])


def test_filter_groups_drops_zero_signal_and_failed_rollouts():
    signal = group(1.0, 0.0, task_id="a")
    flat = group(1.0, 1.0, task_id="b")
    with_failure = Group("c", "test", [rollout(1.0), rollout(0.0, failed=True), rollout(0.0)])
    only_one_left = Group("d", "test", [rollout(1.0), rollout(0.0, failed=True)])

    result = filter_groups([signal, flat, with_failure, only_one_left], policy="drop")

    assert [g.task_id for g in result.groups] == ["a", "c"]
    assert result.advantages == [[0.5, -0.5], [0.5, -0.5]]
    assert len(result.groups[1].rollouts) == 2 and not any(r.failed for r in result.groups[1].rollouts)
    assert result.num_zero_signal == 2  # b (equal rewards) and d (one usable rollout)
    assert result.num_failed_rollouts == 2
    assert len(with_failure.rollouts) == 3  # the input is not modified


def test_filter_groups_keep_and_refill():
    groups = [group(1.0, 0.0, task_id="a"), group(0.5, 0.5, task_id="b")]
    kept = filter_groups(groups, policy="keep")
    assert [g.task_id for g in kept.groups] == ["a", "b"]
    assert kept.advantages == [[0.5, -0.5], [0.0, 0.0]]
    assert kept.num_zero_signal == 1
    refill = filter_groups(groups, policy="refill")
    assert [g.task_id for g in refill.groups] == ["a"] and refill.num_zero_signal == 1


def test_filter_groups_uses_the_advantage_kind():
    result = filter_groups([group(3.0, 1.0, 2.0)], kind="rloo")
    assert result.advantages == [pytest.approx([1.5, -1.5, 0.0])]


def test_stale_bound():
    assert not stale(group_version=3, step=5, max_async_level=2)  # 5 − 3 = 2 ≤ 2
    assert stale(group_version=2, step=5, max_async_level=2)  # 5 − 2 = 3 > 2
    assert not stale(group_version=4, step=4, max_async_level=0)  # synchronous: same version only
    assert stale(group_version=3, step=4, max_async_level=0)


def test_split_stale_judges_a_group_by_its_oldest_rollout():
    mixed = Group("mixed", "test", [rollout(1.0, version=4), rollout(0.0, version=2)])
    fresh = group(1.0, 0.0, version=4, task_id="fresh")
    split = split_stale([mixed, fresh], step=5, max_async_level=2)
    assert [g.task_id for g in split.fresh] == ["fresh"]
    assert [g.task_id for g in split.stale] == ["mixed"]
    assert split.num_stale_rollouts == 2


def test_staleness_tracker_counts_across_steps_and_resumes():
    tracker = StalenessTracker(max_async_level=1)
    split = tracker.keep_fresh([group(1.0, 0.0, version=0), group(1.0, 0.0, 0.0, version=1)], step=2)
    assert len(split.fresh) == 1 and len(split.stale) == 1
    tracker.keep_fresh([group(1.0, version=0), group(1.0, version=3)], step=3)
    assert tracker.num_dropped_groups == 2
    assert tracker.num_dropped_rollouts == 3  # 2 at step 2, 1 at step 3

    resumed = StalenessTracker(max_async_level=1)
    resumed.load_state_dict(tracker.state_dict())
    assert resumed.state_dict() == {"num_dropped_groups": 2, "num_dropped_rollouts": 3}


def test_negative_async_level_is_rejected():
    with pytest.raises(ValueError, match="max_async_level"):
        StalenessTracker(-1)
    with pytest.raises(ValueError, match="max_async_level"):
        split_stale([], step=0, max_async_level=-1)


def test_failed_rollouts_do_not_make_a_group_stale():
    # a rollout that failed before any model call has no policy version (it carries 0)
    failed_early = rollout(0.0, version=0, failed=True)
    all_failed = Group("a", "test", [failed_early, failed_early])
    mixed = Group("b", "test", [rollout(1.0, version=5), failed_early, rollout(0.0, version=5)])
    split = split_stale([all_failed, mixed], step=5, max_async_level=0)
    assert split.stale == [] and [g.task_id for g in split.fresh] == ["a", "b"]
    assert split_stale([mixed], step=7, max_async_level=1).stale == [mixed]  # usable ones still judged


def test_a_group_with_every_rollout_failed_is_failed_not_zero_signal_and_never_kept():
    failed = Group("a", "test", [rollout(0.0, failed=True), rollout(0.0, failed=True)])
    for policy in ("keep", "drop"):
        result = filter_groups([failed, group(1.0, 0.0)], policy=policy)
        assert [g.task_id for g in result.groups] == ["t"]
        assert (
            result.num_failed_groups == 1 and result.num_zero_signal == 0 and result.num_failed_rollouts == 2
        )

"""The difficulty curriculum's pure logic: what a stream position picks, what a group teaches it, its state."""

import json
import random

import pytest

from tidal.config.rl import CurriculumConfig, OrchestratorConfig
from tidal.orchestrator.curriculum import Curriculum, next_streak


def curriculum(num_tasks: int = 20, **config) -> Curriculum:
    return Curriculum(CurriculumConfig(**config), num_tasks=num_tasks, seed=0)


def test_with_nothing_seen_each_position_runs_the_task_the_uniform_stream_would():
    c = curriculum(num_tasks=7)
    assert [c.pick(p) for p in range(30)] == [p % 7 for p in range(30)]
    assert c.take_metrics()["curriculum/passed_over"] == 0


def test_odds_are_one_at_the_target_and_fall_linearly_to_min_weight_at_both_ends():
    c = curriculum(target_pass_rate=0.5, min_weight=0.1, skip_after=None)
    for index, share in enumerate([0.0, 0.25, 0.5, 1.0]):
        c.pick(index)
        c.observe(index, [1.0] * round(share * 4) + [0.0] * (4 - round(share * 4)))
    assert [c.odds(i) for i in range(4)] == pytest.approx([0.1, 0.55, 1.0, 0.1])
    assert c.odds(19) == 1.0  # never seen


def test_a_task_solved_skip_after_times_in_a_row_is_never_drawn_again():
    c = curriculum(num_tasks=5, skip_after=2)
    for _ in range(2):  # task 3 solved by two groups in a row
        position = 3 + 5 * _
        assert c.pick(position) == 3
        c.observe(position, [1.0, 1.0, 1.0])
    assert c.odds(3) == 0.0
    picked = [c.pick(p) for p in range(10, 60)]
    assert 3 not in picked
    assert c.take_metrics()["curriculum/tasks_skipped"] == 1.0


def test_a_mixed_group_ends_a_streak_and_failures_count_against_it():
    assert [next_streak(s, share) for s, share in [(0, 1.0), (2, 1.0), (-1, 1.0), (3, 0.5), (1, 0.0), (-2, 0.0)]] == [
        1, 3, 1, 0, -1, -3
    ]  # fmt: skip
    c = curriculum(skip_after=3, min_weight=1.0)  # every seen task has odds 1 until skipped
    for position in (0, 20, 40):
        assert c.pick(position) == 0
        c.observe(position, [0.0, 0.0])
    assert c.tasks[0].streak == -3 and c.odds(0) == 0.0


def test_a_group_whose_every_sample_failed_teaches_nothing_and_frees_its_position():
    c = curriculum()
    c.pick(4)
    c.observe(4, [])
    assert 4 not in c.tasks and 4 not in c.picks


def test_a_position_keeps_its_pick_until_its_group_ends():
    c = curriculum(num_tasks=4, skip_after=1)
    assert c.pick(1) == 1
    c.pick(5)
    c.observe(5, [1.0, 1.0])  # task 1 (position 5's) now skipped
    assert c.pick(1) == 1, "a cancelled group runs again with the task it was drawn with"
    c.observe(1, [0.0, 1.0])
    assert 1 not in c.picks


def test_when_every_task_is_skipped_the_best_candidate_is_taken_and_counted():
    c = curriculum(num_tasks=3, skip_after=1, max_draws=4)
    for position in range(3):
        c.pick(position)
        c.observe(position, [1.0])
    index = c.pick(3)
    assert 0 <= index < 3
    metrics = c.take_metrics()
    assert metrics["curriculum/fallbacks"] == 1.0 and metrics["curriculum/passed_over"] == 4.0
    assert c.take_metrics()["curriculum/fallbacks"] == 0.0  # per step


def simulate(c: Curriculum | None, true_rates: list[float], num_groups: int, group_size: int = 8) -> float:
    """Share of groups with no learning signal (all passed or none) over `num_groups` groups."""
    rng = random.Random(1)
    zero_signal = 0
    for position in range(num_groups):
        index = position % len(true_rates) if c is None else c.pick(position)
        rewards = [float(rng.random() < true_rates[index]) for _ in range(group_size)]
        zero_signal += len(set(rewards)) == 1
        if c is not None:
            c.observe(position, rewards)
    return zero_signal / num_groups


def test_against_uniform_draws_it_spends_far_fewer_groups_on_tasks_without_signal():
    # 40 tasks: 30 always solved or never solved, 10 near the target
    rates = [1.0] * 15 + [0.0] * 15 + [0.5] * 10
    uniform = simulate(None, rates, 400)
    with_curriculum = simulate(curriculum(num_tasks=40), rates, 400)
    print(f"\nzero-signal groups: uniform {uniform:.2f}, curriculum {with_curriculum:.2f}")
    assert uniform > 0.7
    assert with_curriculum < 0.3


def test_its_state_through_json_continues_exactly_where_it_was():
    c = curriculum(num_tasks=40)
    rates = [1.0] * 15 + [0.0] * 15 + [0.5] * 10
    simulate(c, rates, 100)
    c.pick(100)  # drawn, not ended: a saved state must keep it
    restored = curriculum(num_tasks=40)
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()
    assert [restored.pick(p) for p in range(100, 160)] == [c.pick(p) for p in range(100, 160)]


def test_bad_settings_are_config_problems():
    with pytest.raises(ValueError, match="target_pass_rate"):
        CurriculumConfig(target_pass_rate=1.0)
    config = OrchestratorConfig.model_validate({"curriculum": {}})
    assert config.curriculum == CurriculumConfig()
    assert OrchestratorConfig().curriculum is None

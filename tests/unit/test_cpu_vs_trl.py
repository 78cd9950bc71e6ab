"""The TRL comparison's pure parts: shared settings from rl.toml, the tidal config, time to the target reward.

Nothing here imports trl (a benchmark-only dependency)."""

import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports

from benchmarks.cpu_vs_trl import (  # noqa: E402
    REPO,
    RL_CONFIG,
    check_loss_matches,
    compare,
    env_rewards,
    lr_factor,
    parse_settings,
    running_means,
    task_from_rl_config,
    tidal_rl_config,
    time_to_reach,
    trl_config_kwargs,
)
from tidal.config.common import SchedulerConfig  # noqa: E402
from tidal.trainer.optim import lr_factor as tidal_lr_factor  # noqa: E402


@pytest.fixture
def rl() -> dict:
    return tomllib.loads((REPO / RL_CONFIG).read_text())


def test_running_means_start_at_the_window() -> None:
    assert running_means([1, 2, 3, 4], window=2) == [None, 1.5, 2.5, 3.5]
    assert running_means([1.0], window=2) == [None]


def test_time_to_reach_is_the_first_window_at_the_target() -> None:
    times = [10.0, 11.0, 12.0, 13.0, 14.0]
    rewards = [0.0, 0.2, 0.4, 0.2, 0.6]
    assert time_to_reach(times, rewards, 0.3, window=2) == (12.0, 2)
    assert time_to_reach(times, rewards, 0.5, window=2) is None


def test_compare_divides_tidal_time_by_trl_time_to_trl_final_reward() -> None:
    trl = {"rewards": [0.0] * 10 + [1.0] * 10, "reward_times": [float(i) for i in range(20)], "wall_s": 25.0}
    # tidal climbs at the same rate but its steps come twice as fast after a longer start
    tidal = {"rewards": [0.0] * 10 + [1.0] * 15, "reward_times": [5.0 + 0.5 * i for i in range(25)]}
    out = compare(trl, tidal, window=10)
    assert out["target_reward"] == 1.0 and out["trl_gain"] == 1.0
    assert out["trl_time_to_target_s"] == 19.0 and out["trl_step_at_target"] == 19
    assert out["tidal_time_to_target_s"] == 5.0 + 0.5 * 19
    assert out["ratio"] == pytest.approx(14.5 / 19.0)
    assert out["ratio_vs_trl_wall"] == pytest.approx(14.5 / 25.0)


def test_compare_says_when_tidal_never_gets_there() -> None:
    trl = {"rewards": [0.0] * 10 + [1.0] * 10, "reward_times": [float(i) for i in range(20)], "wall_s": 25.0}
    tidal = {"rewards": [0.0] * 20, "reward_times": [float(i) for i in range(20)]}
    out = compare(trl, tidal, window=10)
    assert out["ratio"] is None and "did not reach" in out["note"]


def test_shared_settings_come_from_rl_toml(rl: dict) -> None:
    check_loss_matches(rl)
    task = task_from_rl_config(rl, seed=1, steps=60)
    assert (task.num_prompts, task.group_size, task.lr, task.max_tokens) == (16, 8, 8e-4, 24)
    assert task.env_seed == rl["orchestrator"]["env"][0]["kwargs"]["seed"] + 1


def test_tidal_config_changes_only_what_the_comparison_needs(rl: dict) -> None:
    task = task_from_rl_config(rl, seed=1, steps=80)
    config, changes = tidal_rl_config(rl, task, "/w/final", "/w/out", 18650, online_eval=False)
    assert config["max_steps"] == 80 and config["seed"] == 1 and config["model"]["name"] == "/w/final"
    assert config["orchestrator"]["env"][0]["kwargs"]["seed"] == task.env_seed
    assert config["orchestrator"]["batch"]["zero_signal"] == "keep"
    assert "online_eval" not in config["orchestrator"] and "orchestrator.online_eval" in changes
    # the rest is rl.toml's, and rl.toml itself is left alone
    assert (
        config["trainer"] == rl["trainer"]
        and config["orchestrator"]["sampling"] == rl["orchestrator"]["sampling"]
    )
    assert "online_eval" in rl["orchestrator"] and rl["max_steps"] != 80


def test_trl_takes_the_same_batch_and_sampling(rl: dict) -> None:
    task = task_from_rl_config(rl, seed=0, steps=60)
    kwargs = trl_config_kwargs(task, "/w/trl")
    assert kwargs["per_device_train_batch_size"] // kwargs["num_generations"] == task.num_prompts
    assert kwargs["max_completion_length"] == task.max_tokens and kwargs["temperature"] == task.temperature
    assert (kwargs["beta"], kwargs["loss_type"], kwargs["scale_rewards"]) == (0.0, "dapo", "group")
    assert kwargs["shuffle_dataset"] is False and kwargs["use_vllm"] is False


def test_trl_lr_schedule_is_tidal_s() -> None:
    config = SchedulerConfig(type="constant", warmup_steps=10)
    for step in range(30):
        assert lr_factor(step, 10) == pytest.approx(tidal_lr_factor(step, 60, config))


def test_tidal_set_changes_tidal_s_side_last(rl: dict) -> None:
    extra = parse_settings(["max_async_level=0", 'orchestrator.batch.zero_signal="drop"'])
    assert extra == {"max_async_level": 0, "orchestrator.batch.zero_signal": "drop"}
    task = task_from_rl_config(rl, seed=0, steps=60)
    config, changes = tidal_rl_config(rl, task, "/w/final", "/w/out", 18650, online_eval=True, extra=extra)
    assert config["max_async_level"] == 0 and config["orchestrator"]["batch"]["zero_signal"] == "drop"
    assert changes["max_async_level"] == 0 and "online_eval" in config["orchestrator"]


def test_trl_completions_score_as_tidal_scores_its_rollouts() -> None:
    """The TRL workers' reward is the environment's weighted rewards on prompt + completion, per sample."""
    from tidal.envs.base import Episode
    from tidal.envs.reverse_text import ReverseTextEnv

    env = ReverseTextEnv(num_examples=4, seed=0)
    tasks = [env.task(0), env.task(1)]
    prompts = [t.messages for t in tasks]
    completions = [
        [{"role": "assistant", "content": tasks[0].answer}],
        [{"role": "assistant", "content": "something else"}],
    ]
    got = env_rewards(env, tasks, prompts, completions)
    want = [
        sum(w * fn(t, Episode(prompt_ids=[], messages=[*p, *c])) for fn, w in env.rewards)
        for t, p, c in zip(tasks, prompts, completions, strict=True)
    ]
    assert got == pytest.approx(want)
    assert got[0] > got[1]

"""Built-in demonstration datasets: each one, replayed through its environment's own rollout, earns full
marks, meets the environment's turns exactly and tokenises for SFT as the rollout sampled it; the splits share
no task, and the held-out demonstrations are the tasks RL's online eval holds out; bad settings are one-line
errors."""

import asyncio
import json

import pytest

from tests.unit.test_envs_multiturn import ScriptedSampler
from tidal.config.envs import EnvSpec
from tidal.config.loader import load_config
from tidal.config.rl import heldout_spec
from tidal.config.sft import SFTConfig
from tidal.envs import reverse_text
from tidal.envs.base import run_episode, token_ids
from tidal.envs.demonstrations import env_demonstrations, generate_demonstrations
from tidal.envs.registry import load_env
from tidal.envs.wordle import WORDS
from tidal.errors import UserError
from tidal.trainer.data import tokenize_conversation
from tidal.trainer.evaluate import prompt_text
from tidal.trainer.sources import load_conversations

FULL_MARKS = {"alphabet_sort": 1.0, "math": 1.0, "tool_use": 1.2, "code": 1.0, "wordle": 1.2, "swe": 1.0}
"""The highest reward of each environment (wordle: solved 1.0 + 0.2 × all five letters green; tool_use: the
answer 1.0 + 0.2 for computing it with a tool)."""


def replay(name: str, kwargs: dict, count: int, split: str = "train"):
    """(task, demonstration, episode, sampler) of the first `count` demonstrations, each replayed by a sampler
    that says exactly the demonstration's assistant turns."""
    env = load_env(name, **kwargs, split=split)
    out = []
    for task in [env.task(i) for i in range(count)]:
        demonstration = env.demonstration(task)
        replies = [m["content"] for m in demonstration if m["role"] == "assistant"]
        sampler = ScriptedSampler(replies)
        episode = asyncio.run(run_episode(env, task, sampler))
        out.append((task, demonstration, episode, sampler))
    return out


@pytest.mark.parametrize(
    ("name", "kwargs", "count"),
    [
        ("alphabet_sort", {"num_examples": 200, "min_turns": 2, "max_turns": 3}, 8),
        ("math", {"num_examples": 200}, 12),
        ("math", {"num_examples": 200, "level": ["arithmetic", "products"]}, 12),
        ("tool_use", {"num_examples": 200, "sandbox": "process"}, 9),
        ("code", {"sandbox": "process"}, 15),
        ("wordle", {"num_examples": 200}, 8),
        ("swe", {"timeout": 5}, 4),
    ],
)
def test_demonstrations_replayed_by_the_environment_earn_full_marks(name, kwargs, count):
    for task, demonstration, episode, sampler in replay(name, kwargs, count):
        assert episode.reward == pytest.approx(FULL_MARKS[name]), (task.task_id, episode.messages)
        # the environment's own turns (feedback, new names, tool results) are the demonstration's
        assert episode.messages[1:] == demonstration[1:]
        # the prompt the rollout rendered is the demonstration's, as SFT renders it (tool environments: the
        # tools the demonstration carries, described as the rollout's prompt describes them)
        assert sampler.prompts[0] == token_ids(
            sampler.tokenizer, prompt_text(sampler.tokenizer, demonstration[:2])
        )
        # SFT learns exactly the tokens the rollout sampled, and nothing the environment said
        sample = tokenize_conversation(sampler.tokenizer, demonstration)
        context = episode.context_ids
        assert sample.input_ids[: len(context)] == context
        start = len(episode.prompt_ids)
        assert sample.loss_mask[start : len(context)] == episode.completion_mask
        assert sum(sample.loss_mask) == sum(episode.completion_mask)


def test_multi_turn_and_tool_demonstrations_have_every_turn():
    (_, sort_demo, *_), *_ = replay("alphabet_sort", {"num_examples": 50, "min_turns": 3}, 1)
    assert [m["role"] for m in sort_demo] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    tool_demo = generate_demonstrations("tool_use", "train", 30, None, {"sandbox": "process"})
    assert all(
        [m["role"] for m in d] == ["system", "user", "assistant", "tool", "assistant"] for d in tool_demo
    )
    assert {'"name": "calculator"' in d[2]["content"] for d in tool_demo} == {True, False}


def prompts(env) -> list[str]:  # type: ignore[no-untyped-def]
    return [json.dumps([env.task(i).messages, env.task(i).answer]) for i in range(env.num_tasks())]


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("alphabet_sort", {}),
        ("math", {}),
        ("math", {"level": "arithmetic"}),
        ("math", {"level": "products"}),
        ("tool_use", {"sandbox": "process"}),
    ],
)
def test_train_and_heldout_share_no_task_and_heldout_has_200_distinct(name, kwargs):
    train = load_env(name, num_examples=3000, **kwargs)
    heldout = load_env(name, num_examples=200, split="heldout", **kwargs)
    held = prompts(heldout)
    assert len(set(held)) == 200 and not set(held) & set(prompts(train))
    assert len(set(prompts(train))) == 3000  # each split's tasks are distinct tasks


def test_wordle_and_code_splits_partition_their_lists():
    # wordle: no hidden word is in both splits (a demonstration ends with the winning guess)
    won = {
        split: {d[-1]["content"] for d in generate_demonstrations("wordle", split, None, None, {})}
        for split in ("train", "heldout")
    }
    assert won["train"] and won["heldout"] and not won["train"] & won["heldout"]
    # the solver wins all but a few of the 2168 words within six guesses
    assert len(WORDS) - 20 < len(won["train"] | won["heldout"]) <= len(WORDS)
    ids = {split: {t.id for t in load_env("code", split=split).tasks} for split in ("train", "heldout")}
    assert ids["heldout"] == {"fibonacci", "gcd", "to_binary"} and not ids["train"] & ids["heldout"]
    assert len(ids["train"] | ids["heldout"]) == 18


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("alphabet_sort", {"num_examples": 3000, "max_turns": 2}),
        ("math", {"num_examples": 3000, "level": "products", "seed": 3}),
        ("tool_use", {"num_examples": 3000, "sandbox": "process"}),
        ("code", {}),
        ("code", {"generated": True, "num_examples": 3000}),
        ("wordle", {"num_examples": 3000}),
    ],
)
def test_sfts_heldout_demonstrations_are_the_tasks_rl_evaluates_online(name, kwargs):
    evaluated = load_env(name, **heldout_spec(EnvSpec(name=name, kwargs=kwargs), 40).kwargs)
    tasks = [evaluated.task(i) for i in range(evaluated.num_tasks())]
    assert len(tasks) == (3 if name == "code" and not kwargs else 40)  # the shipped file holds 3
    demonstrations = generate_demonstrations(name, "heldout", min(len(tasks), 30), None, kwargs)
    if name == "wordle":  # a demonstration per word the solver wins within six guesses
        assert {d[-1]["content"] for d in demonstrations} <= {f"<guess>{t.answer}</guess>" for t in tasks}
        return
    # the same questions (tool_use's demonstrations also list the tools in the system message)
    assert [d[1 : len(t.messages)] for d, t in zip(demonstrations, tasks, strict=False)] == [
        t.messages[1:] for t in tasks[: len(demonstrations)]
    ]


def test_the_seed_changes_tasks_and_sizes_are_kept():
    first = generate_demonstrations("math", "train", 20, None, {"num_examples": 100})
    assert first == generate_demonstrations("math", "train", 20, 0, {"num_examples": 100})
    assert first != generate_demonstrations("math", "train", 20, 1, {"num_examples": 100})
    assert len(first) == 20
    env = load_env("alphabet_sort", num_examples=100, split="heldout")
    assert len(env_demonstrations(env, None)) == 100


def test_reverse_text_keeps_its_generator():
    source = load_config(SFTConfig, [], [("data.train.type", "builtin"), ("data.train.num_examples", 5)])
    assert load_conversations(source.data.train) == reverse_text.generate_conversations("train", 5, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("code", "train", 100, None, {}),
            "has 15 demonstrations of 15 tasks, fewer than num_examples = 100",
        ),
        (("code", "train", None, 3, {}), "seed picks generated tasks"),
        (("math", "train", None, 1, {"seed": 2}), "seed is given twice"),
        (("math", "train", None, None, {"split": "heldout"}), "split is given twice"),
        (("math", "validation", None, None, {}), "split must be one of train, heldout"),
        (("reverse_text", "train", 5, None, {"max_turns": 2}), "takes no kwargs"),
        (("wordle", "train", 5, None, {"colour": "green"}), "unexpected keyword argument 'colour'"),
        (("code", "heldout", None, None, {"num_examples": 5}), "there are 3 tasks in the heldout split"),
        (("math", "train", None, None, {"level": "calculus"}), "level must be one of arithmetic"),
    ],
)
def test_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(UserError, match=message) as caught:
        generate_demonstrations(*args)
    assert "\n" not in str(caught.value)


def test_an_unknown_dataset_name_is_a_config_error_listing_the_names():
    with pytest.raises(UserError) as caught:
        load_config(SFTConfig, [], [("data.train.type", "builtin"), ("data.train.name", "chess")])
    text = str(caught.value)
    assert "data.train.name" in text and "unknown built-in dataset 'chess'" in text
    assert "alphabet_sort, code, math, reverse_text, search, shapes, swe, tool_use, wordle" in text

"""Multi-turn environments on scripted replies: exact token continuation, masks, generation and scoring."""

import asyncio

import pytest

from tidal.envs.alphabet_sort import (
    AlphabetSortEnv,
    expected_lists,
    list_agreement,
    parse_names,
)
from tidal.envs.base import Episode, Turn, render_prompt, run_episode
from tidal.envs.wordle import MAX_GUESSES, WordleEnv, feedback, parse_guess
from tidal.testing.tiny import build_tokenizer


class ScriptedSampler:
    """Answers each turn with the next scripted text (EOS appended, as a model that stops would)."""

    def __init__(self, replies: list[str]):
        self.tokenizer = build_tokenizer()
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def complete(self, prompt_ids: list[int]) -> Turn:
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0) if self.replies else ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        return Turn(list(prompt_ids), ids, [-0.5] * len(ids), text, "stop")


def roll(env, task, replies):
    sampler = ScriptedSampler(replies)
    return asyncio.run(run_episode(env, task, sampler)), sampler


def check_token_invariants(episode: Episode, sampler: ScriptedSampler) -> None:
    """Each prompt = previous prompt + its sampled ids (mask 1) + environment ids (mask 0), nothing re-tokenised."""
    n = len(episode.prompt_ids)
    assert len(episode.completion_ids) == len(episode.completion_mask) == len(episode.completion_logprobs)
    assert sampler.prompts[0] == episode.prompt_ids
    ends = [*sampler.prompts[1:], episode.context_ids]
    for prompt, sampled, end in zip(sampler.prompts, sampler.sampled, ends, strict=True):
        assert end[: len(prompt) + len(sampled)] == prompt + sampled
        assert episode.completion_mask[len(prompt) - n : len(prompt) - n + len(sampled)] == [1] * len(sampled)
        assert episode.completion_mask[len(prompt) - n + len(sampled) : len(end) - n] == [0] * (
            len(end) - len(prompt) - len(sampled)
        )
    assert sum(episode.completion_mask) == sum(len(s) for s in sampler.sampled)


def test_alphabet_sort_tasks_are_deterministic_and_hide_later_names():
    env = AlphabetSortEnv(num_examples=100, seed=3, min_turns=2, max_turns=3)
    task = env.task(7)
    assert task == AlphabetSortEnv(num_examples=100, seed=3, min_turns=2, max_turns=3).task(7)
    assert task != AlphabetSortEnv(num_examples=100, seed=4, min_turns=2, max_turns=3).task(7)
    batches = task.info["turns"]
    assert 2 <= len(batches) <= 3
    assert task.messages[-1]["content"] == ", ".join(batches[0])
    flat = [n for b in batches for n in b]
    assert len(set(flat)) == len(flat)
    assert expected_lists(task)[-1] == sorted(flat, key=str.lower)


def test_alphabet_sort_perfect_rollout_continues_exact_tokens():
    env = AlphabetSortEnv(num_examples=10, seed=0, min_turns=3, max_turns=3)
    task = env.task(0)
    replies = ["\n".join(names) for names in expected_lists(task)]
    episode, sampler = roll(env, task, replies)
    assert episode.num_turns == 3 and len(sampler.prompts) == 3
    assert episode.reward == 1.0 and episode.metrics["reward/all_turns_exact"] == 1.0
    check_token_invariants(episode, sampler)
    assert sampler.prompts[0] == render_prompt(sampler.tokenizer, task.messages)
    # the environment's text between turns is the user's next names, never trained on
    tok = sampler.tokenizer
    env_ids = [i for i, m in zip(episode.completion_ids, episode.completion_mask, strict=True) if m == 0]
    assert "Add: " + ", ".join(task.info["turns"][1]) in tok.decode(env_ids)


@pytest.mark.parametrize(
    ("replies", "low", "high"),
    [
        ([""], 0.0, 0.0),  # empty
        (["x" * 50_000], 0.0, 0.0),  # huge
        (["<names>whatever</names>"], 0.0, 0.0),  # wrong format
    ],
)
def test_alphabet_sort_adversarial_replies_score_low(replies, low, high):
    env = AlphabetSortEnv(num_examples=10, seed=0, min_turns=2, max_turns=2)
    episode, _ = roll(env, env.task(1), replies)
    assert low <= episode.reward <= high
    assert episode.num_turns == 2  # the environment keeps going; missing answers score 0


def test_alphabet_sort_partial_credit_and_formats():
    assert parse_names("1. Ada\n- Bela\n* Cara, Dina\n\n") == ["Ada", "Bela", "Cara", "Dina"]
    assert list_agreement(["Ada", "Bela"], ["Ada", "Bela", "Cara"]) == pytest.approx(2 / 3)
    assert list_agreement(["Ada", "Bela", "Cara", "Zed"], ["Ada", "Bela", "Cara"]) == pytest.approx(3 / 4)
    env = AlphabetSortEnv(num_examples=10, seed=0, min_turns=2, max_turns=2)
    task = env.task(2)
    first = "\n".join(expected_lists(task)[0])
    episode, _ = roll(env, task, [first, "nonsense"])
    assert episode.reward == pytest.approx(0.5)


def test_wordle_feedback_handles_repeated_letters():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("nacre", "crane") == "YYYYG"
    assert feedback("geese", "these") == "--GGG"
    assert feedback("eerie", "these") == "Y---G"  # only as many E's as the secret has
    assert feedback("abbey", "kebab") == "YYGY-"


def test_wordle_guess_parsing():
    assert parse_guess("I think <guess>CRANE</guess>") == "crane"
    assert parse_guess("<guess>cran</guess>") is None
    assert parse_guess("<guess>cr4ne</guess>") is None
    assert parse_guess("crane") is None
    assert parse_guess("<guess>slate</guess> no wait <guess>crane</guess>") == "crane"


def test_wordle_solved_game_and_tokens():
    env = WordleEnv(num_examples=20, seed=0)
    task = env.task(5)
    secret = task.answer
    wrong = "zzzzz" if secret != "zzzzz" else "yyyyy"
    episode, sampler = roll(env, task, [f"<guess>{wrong}</guess>", f"<guess>{secret}</guess>"])
    assert episode.info["solved"] and episode.num_turns == 2
    assert episode.reward == pytest.approx(1.0 + 0.2)
    assert episode.metrics["wordle/num_guesses"] == 2
    assert "ZZZZZ" in episode.messages[-2]["content"] or "YYYYY" in episode.messages[-2]["content"]
    check_token_invariants(episode, sampler)


def test_wordle_invalid_and_exhausted_games_end_after_six_guesses():
    env = WordleEnv(num_examples=20, seed=0)
    task = env.task(1)
    episode, sampler = roll(
        env, task, ["", "x" * 100_000, "<guess>{bad json</guess>"] + ["<guess>qqqqq</guess>"] * 10
    )
    assert episode.num_turns == MAX_GUESSES and len(sampler.prompts) == MAX_GUESSES
    assert not episode.info["solved"] and episode.info["num_invalid"] == 3
    assert episode.metrics["reward/valid_guesses"] == pytest.approx(3 / 6)
    assert 0.0 <= episode.reward < 1.0


def test_wordle_rejects_bad_word_lists():
    with pytest.raises(ValueError):
        WordleEnv(words=["toolong"])

"""Multi-turn environments on scripted replies: exact token continuation, masks, generation and scoring,
with the tiny model's ChatML template and with the Qwen3-style one (which re-renders history)."""

import asyncio
import json
import re
from collections.abc import Sequence

import pytest

from tidal.envs.alphabet_sort import (
    AlphabetSortEnv,
    expected_lists,
    list_agreement,
    parse_names,
    split_key,
)
from tidal.envs.base import ContextFull, Episode, Turn, answer_text, render_prompt, run_episode
from tidal.envs.tool_use import ToolUseEnv
from tidal.envs.wordle import MAX_GUESSES, WORDS, WordleEnv, feedback, feedback_table, parse_guess
from tidal.models.templates import QWEN3_STYLE_TEMPLATE
from tidal.models.tiny import build_tokenizer


class ScriptedSampler:
    """Answers each turn with the next scripted text (EOS appended, as a model that stops would)."""

    def __init__(self, replies: list[str], tokenizer=None):  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer or build_tokenizer()
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0) if self.replies else ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        return Turn(list(prompt_ids), ids, [-0.5] * len(ids), text, "stop")


def roll(env, task, replies, tokenizer=None):
    sampler = ScriptedSampler(replies, tokenizer)
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


@pytest.mark.parametrize(
    ("reply", "names"),
    [
        # SmolLM2-135M-Instruct's replies: a lead-in line, a full stop after the last name
        ("The names are:\n\nJada, Cato, Vik, Jiro, Olga", ["Jada", "Cato", "Vik", "Jiro", "Olga"]),
        ("Alan, Leon, Zara, Umar, Omar.", ["Alan", "Leon", "Zara", "Umar", "Omar"]),
        # Qwen2.5-Coder-0.5B-Instruct's: one comma line
        ("Pia, Mara, Rosa", ["Pia", "Mara", "Rosa"]),
        ("Here is the sorted list:\n1. Ada\n2. Bela", ["Ada", "Bela"]),
        ("```\nAda\nBela\n```", ["Ada", "Bela"]),
        ("**Ada**\n**Bela**", ["Ada", "Bela"]),
        ("Ada, Bela and Cara", ["Ada", "Bela", "Cara"]),
        ("Ada Bela Cara", ["Ada", "Bela", "Cara"]),
        ("Sure! Sorted: Ada, Bela\nI hope this helps.", ["Ada", "Bela"]),
        ("nonsense", ["nonsense"]),  # a wrong word still costs
    ],
)
def test_alphabet_sort_reads_what_real_models_write(reply, names):
    assert parse_names(reply) == names


def test_alphabet_sort_splits_share_no_names_and_hold_200_distinct_tasks():
    heldout = AlphabetSortEnv(num_examples=200, split="heldout")
    keys = {split_key(heldout.task(i)) for i in range(200)}
    assert len(keys) == 200 and heldout.task(5).task_id == "alphabet_sort/5"
    train = AlphabetSortEnv(num_examples=3000)
    assert not keys & {split_key(train.task(i)) for i in range(3000)}
    assert heldout.task(17) == AlphabetSortEnv(num_examples=200, split="heldout").task(17)


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
    assert parse_guess("<guess>slate</guess> no wait <guess>crane</guess>") == "crane"
    # a reply that is one word and nothing else is that guess; a word inside prose is not
    assert parse_guess("crane") == parse_guess("**CRANE**") == parse_guess('"Crane".') == "crane"
    assert parse_guess("Guess the five-letter word.") is None  # what SmolLM2-135M-Instruct replied
    assert parse_guess("crane slate") is None and parse_guess("cranes") is None


def test_every_example_in_wordles_prompts_is_a_valid_guess():
    """Qwen2.5-Coder-0.5B copied the prompt's `<guess>word</guess>` literally: four letters, invalid every
    turn. Every `<guess>` a prompt or a reply of the environment shows must itself be a valid guess."""
    env = WordleEnv(num_examples=5)
    task = env.task(0)
    episode, _ = roll(env, task, ["<guess>word</guess>", "<guess>zzzzz</guess>", task.answer.upper()])
    texts = [m["content"] for m in episode.messages if m["role"] != "assistant"]
    examples = [example for text in texts for example in re.findall(r"<guess>.*?</guess>", text)]
    assert len(examples) >= 2 and all(parse_guess(example) is not None for example in examples)
    assert episode.info["num_invalid"] == 1 and episode.info["solved"] and episode.num_turns == 3


def test_wordle_splits_hold_distinct_real_words_never_shared():
    assert len(WORDS) == len(set(WORDS)) >= 2000
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in WORDS)
    heldout = WordleEnv(num_examples=500, split="heldout")
    train = WordleEnv(num_examples=5000)
    held = [heldout.task(i).answer for i in range(500)]
    # each word once before any repeats: the first 226 held-out games are 226 different words
    assert len(set(held[:226])) == len(set(held)) == len(heldout.secrets) == 226
    assert set(heldout.secrets) | set(train.secrets) == set(WORDS)
    assert not set(held) & {train.task(i).answer for i in range(5000)}
    assert heldout.task(300) == WordleEnv(num_examples=500, split="heldout").task(300)
    assert heldout.task(3) != WordleEnv(num_examples=500, split="heldout", seed=1).task(3)
    with pytest.raises(ValueError, match="split"):
        WordleEnv(split="test")


def test_the_solver_table_is_the_feedback_function():
    words = ("geese", "these", "eerie", "abbey", "kebab", "crane", "nacre")
    table = feedback_table(words)
    for g, guess in enumerate(words):
        for t, secret in enumerate(words):
            code = sum("-YG".index(mark) * 3**i for i, mark in enumerate(feedback(guess, secret)))
            assert table[g, t] == code, (guess, secret)


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


# ---- the Qwen3-style template: `<think>` on the last reply only, reasoning stripped, tool responses ------


def qwen3_tokenizer():  # type: ignore[no-untyped-def]
    return build_tokenizer(chat_template=QWEN3_STYLE_TEMPLATE)


def env_text(episode: Episode, tokenizer) -> list[str]:  # type: ignore[no-untyped-def]
    """The environment's inserted text between model turns, one string per gap (mask-0 runs)."""
    runs: list[list[int]] = []
    previous = 1
    for token, mask in zip(episode.completion_ids, episode.completion_mask, strict=True):
        if mask == 0:
            if previous == 1:
                runs.append([])
            runs[-1].append(token)
        previous = mask
    return [tokenizer.decode(r) for r in runs]


def test_wordle_on_the_qwen3_template_continues_every_turn():
    env = WordleEnv(num_examples=20, seed=0)
    task = env.task(5)
    guesses = ["zzzzz", "yyyyy", task.answer]
    replies = [f"<think>\nmaybe {g}\n</think>\n\n<guess>{g}</guess>" for g in guesses]
    episode, sampler = roll(env, task, replies, qwen3_tokenizer())
    assert episode.info["solved"] and episode.num_turns == 3
    check_token_invariants(episode, sampler)
    gaps = env_text(episode, sampler.tokenizer)
    assert len(gaps) == 2
    for gap, guess in zip(gaps, guesses, strict=False):
        assert gap.startswith("\n<|im_start|>user\n") and gap.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert feedback(guess, task.answer) in gap
    # the model's reasoning stays in its context (the template would drop it from earlier turns)
    assert sampler.tokenizer.decode(sampler.prompts[-1]).count("<think>\nmaybe") == 2


def test_alphabet_sort_on_the_qwen3_template_continues_every_turn():
    env = AlphabetSortEnv(num_examples=10, seed=0, min_turns=3, max_turns=3)
    task = env.task(0)
    replies = ["<think>\n\n</think>\n\n" + "\n".join(names) for names in expected_lists(task)]
    episode, sampler = roll(env, task, replies, qwen3_tokenizer())
    assert episode.num_turns == 3 and episode.reward == 1.0
    check_token_invariants(episode, sampler)
    assert [
        "Add: " + ", ".join(names) in gap
        for gap, names in zip(env_text(episode, sampler.tokenizer), task.info["turns"][1:], strict=True)
    ] == [True, True]


def test_tool_use_on_the_qwen3_template_wraps_tool_results_in_a_user_turn():
    env = ToolUseEnv(num_examples=20)
    index = next(i for i in range(20) if env.task(i).messages[1]["content"].startswith("What is"))
    task = env.task(index)
    expression = task.messages[1]["content"].removeprefix("What is ").removesuffix("?")
    arguments = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    call = f"<tool_call>\n{arguments}\n</tool_call>"
    replies = [call, call + call, f"<answer>{task.answer}</answer>"]
    episode, sampler = roll(env, task, replies, qwen3_tokenizer())
    assert episode.reward == pytest.approx(1.2) and episode.num_turns == 3
    assert episode.metrics["tools/num_tool_calls"] == 3 and episode.metrics["tools/num_tool_errors"] == 0
    check_token_invariants(episode, sampler)
    assert "# Tools" in sampler.tokenizer.decode(episode.prompt_ids)  # the template describes the tools
    response = f"\n<tool_response>\n{task.answer}\n</tool_response>"
    assert env_text(episode, sampler.tokenizer) == [
        f"\n<|im_start|>user{response}<|im_end|>\n<|im_start|>assistant\n",
        f"\n<|im_start|>user{response}{response}<|im_end|>\n<|im_start|>assistant\n",
    ]


def test_rewards_and_tools_read_the_answer_not_the_reasoning():
    assert answer_text("<think>\nAda\nZed\n</think>\n\nAda") == "\n\nAda"
    assert answer_text("<think>still thinking, cut at max_tokens") == ""
    assert answer_text("no reasoning") == "no reasoning"
    wordle = WordleEnv(num_examples=20, seed=0)
    task = wordle.task(5)
    draft = f"<think><guess>{task.answer}</guess> is a guess I could try</think>"
    replies = [draft + "<guess>zzzzz</guess>"] + [f"<think>{draft}"] * 5  # then cut inside the reasoning
    episode, _ = roll(wordle, task, replies, qwen3_tokenizer())
    assert not episode.info["solved"] and episode.info["num_invalid"] == 5
    assert episode.info["feedback"] == [feedback("zzzzz", task.answer)]
    tools = ToolUseEnv(num_examples=5)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    episode, _ = roll(tools, tools.task(0), [f"<think>maybe {call}?</think>no call"], qwen3_tokenizer())
    assert episode.num_turns == 1 and episode.metrics["tools/num_tool_calls"] == 0


class ContextLimitedSampler(ScriptedSampler):
    """A scripted sampler whose served context holds `limit` tokens: a longer prompt raises ContextFull."""

    def __init__(self, replies: list[str], limit: int):
        super().__init__(replies)
        self.limit = limit

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        if len(prompt_ids) >= self.limit:
            raise ContextFull(f"{len(prompt_ids)} tokens")
        return await super().complete(prompt_ids)


def test_an_episode_that_outgrows_the_context_ends_truncated_without_the_reply_no_turn_followed():
    env = AlphabetSortEnv(num_examples=10, seed=0, min_turns=3, max_turns=3)
    task = env.task(0)
    replies = ["\n".join(names) for names in expected_lists(task)]
    full, full_sampler = roll(env, task, replies)
    # room for the first two turns' prompts, not the third's
    limit = len(full_sampler.prompts[2])
    sampler = ContextLimitedSampler(replies, limit)
    episode = asyncio.run(run_episode(env, task, sampler))
    assert episode.info["truncated"] is True
    assert episode.num_turns == 2 and len(sampler.prompts) == 2
    # the episode ends with the second model turn: the user turn that no model turn followed is left out
    assert episode.messages[-1]["role"] == "assistant"
    assert episode.context_ids == sampler.prompts[1] + sampler.sampled[1]
    check_token_invariants(episode, sampler)
    assert 0 < episode.reward < full.reward == 1.0  # scored: the third turn counts as missed


def test_a_first_prompt_past_the_context_fails_the_rollout():
    env = AlphabetSortEnv(num_examples=10, seed=0)
    task = env.task(0)
    with pytest.raises(ContextFull):
        asyncio.run(run_episode(env, task, ContextLimitedSampler(["Anya"], limit=5)))

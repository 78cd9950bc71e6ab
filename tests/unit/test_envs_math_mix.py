"""math generation and math-verify scoring, the env registry, EnvMix and build_envs."""

import asyncio
import re
from collections import Counter

import pytest

from tests.unit.test_envs_multiturn import roll
from tidal.config.env_names import env_names
from tidal.config.envs import EnvSpec
from tidal.envs.base import Episode, SingleTurnEnv, Task
from tidal.envs.math_env import LEVELS, MathEnv, generate_problem, gsm8k_answer, verify_answer
from tidal.envs.mix import EnvMix, env_name
from tidal.envs.registry import build_envs, load_env
from tidal.errors import UserError


def _recompute(question: str) -> int:
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "buys" in question and "gives away" in question:
        return n[0] + n[1] - n[2]
    if "packs" in question:
        return n[0] * n[1] + n[2]
    if "shares" in question:
        return n[0] // n[1]
    return n[2] - n[0] * n[1]


def test_local_problems_are_deterministic_and_their_answers_right():
    for i in range(200):
        question, answer = generate_problem(i, seed=0)
        assert (question, answer) == generate_problem(i, seed=0)
        assert int(answer) == _recompute(question) and int(answer) >= 0
    assert generate_problem(0, 0) != generate_problem(0, 1)


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("So the answer is \\boxed{42}.", 1.0),
        ("\\boxed{42.0}", 1.0),
        ("\\boxed{84/2}", 1.0),
        ("The answer is 42", 1.0),
        ("\\boxed{41}", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("\\boxed{", 0.0),
        ("42" * 200_000 + " \\boxed{7}", 0.0),  # huge: only the tail is parsed, and it is wrong
        ("no numbers at all", 0.0),
    ],
)
def test_verify_answer(completion, score):
    assert verify_answer(completion, "42") == score


@pytest.mark.parametrize(
    ("reply", "reference", "score"),
    [
        # SmolLM2-135M-Instruct's replies (greedy): it never boxed, and often ends in a sentence
        ("So, 10 × 13 = 130.\n\nThe answer is 130.", "130", 1.0),
        (
            "First, we multiply 10 by 86: 10 × 86 = 860.\n\nSo, 10 × 86 = 860.\n\nThe answer is 860.",
            "860",
            1.0,
        ),
        ("So, 18 - 2 = 10.\n\nThe answer is 10.", "16", 0.0),
        ("Therefore, Goran started with 98 pencils.\n#### 98\nThe answer is: 98", "98", 1.0),
        # after `####` the explanation's last number is not the answer
        (
            "#### 59\n\nExplanation: 52 + 13 = 65, and 65 - 6 = 59 shells, leaving him with 3 friends",
            "59",
            1.0,
        ),
        ("#### 3\nHe has 59 shells.", "59", 0.0),
        ("The answer is \\boxed{59}. Check: 59 - 1 = 58", "59", 1.0),
    ],
)
def test_unboxed_final_answers_count(reply, reference, score):
    assert verify_answer(reply, reference) == score


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_levels_are_deterministic_right_and_say_the_answer_format(level):
    env = MathEnv(level=level, num_examples=300)
    assert env.task(12) == MathEnv(level=level, num_examples=300).task(12)
    for index in range(300):
        task = env.task(index)
        assert "\\boxed{}" in task.messages[0]["content"]  # the prompt says the format, with no example
        demonstration = env.demonstration(task)[-1]["content"]
        assert demonstration.endswith(f"\\boxed{{{task.answer}}}") and int(task.answer) >= 0
        if level != "word_problems":
            expression = task.messages[1]["content"].removeprefix("What is ").removesuffix("?")
            assert int(task.answer) == eval(expression.replace("×", "*"))  # our own digits and operators


def test_a_list_of_levels_mixes_them_and_a_bad_level_is_an_error():
    mixed = MathEnv(level=["arithmetic", "products"], num_examples=200)
    questions = [mixed.task(i).messages[1]["content"] for i in range(200)]
    products = sum(all(len(n) == 2 for n in re.findall(r"\d+", q)) and "×" in q for q in questions)
    assert 60 < products < 140
    with pytest.raises(UserError, match="level must be one of arithmetic, products, word_problems"):
        load_env("math", level="calculus")
    assert MathEnv(level="products", system_prompt="Mine.").task(0).messages[0]["content"] == "Mine."


def test_gsm8k_answers_and_math_env_rollout():
    assert gsm8k_answer("She has 3 + 4 = 7 apples.\n#### 1,007") == "1007"
    assert gsm8k_answer("12") == "12"
    env = MathEnv(num_examples=10)
    task = env.task(4)
    episode, _ = roll(env, task, [f"Thinking... \\boxed{{{task.answer}}}"])
    assert episode.reward == 1.0 and episode.metrics["reward/boxed_format"] == 1.0
    episode, _ = roll(env, task, ["I don't know"])
    assert episode.reward == 0.0


def test_registry_builds_every_builtin_and_rejects_bad_input():
    assert set(env_names()) == {
        "reverse_text",
        "alphabet_sort",
        "math",
        "wordle",
        "tool_use",
        "code",
        "shapes",
        "search",
        "swe",
    }
    for name in env_names():
        env = load_env(name, num_examples=5)
        assert env.name == name and env.num_tasks() == 5
        assert env.task(0).task_id.startswith(name)
    with pytest.raises(UserError, match="unknown environment"):
        load_env("chess")
    with pytest.raises(UserError, match="wordle.*unexpected keyword"):
        load_env("wordle", colour="green")
    with pytest.raises(UserError, match="alphabet_sort"):
        load_env("alphabet_sort", min_turns=3, max_turns=1)


class Echo(SingleTurnEnv):
    """A trivial environment whose reward says which environment scored it."""

    def __init__(self, name: str, reward: float, n: int = 10):
        super().__init__(rewards=[(lambda task, episode: reward, 1.0)])
        self.name, self.n = name, n

    def num_tasks(self) -> int:
        return self.n

    def task(self, index: int) -> Task:
        return Task(task_id=f"{self.name}/{index}", messages=[{"role": "user", "content": "hi"}])


def test_env_mix_is_deterministic_by_position_and_follows_weights():
    mix = EnvMix([(Echo("a", 1.0), 3.0), (Echo("b", 0.0, n=7), 1.0)], seed=1)
    picks = [mix.task(p).info["env"] for p in range(4000)]
    share = Counter(picks)["a"] / len(picks)
    assert 0.72 < share < 0.78
    again = EnvMix([(Echo("a", 1.0), 3.0), (Echo("b", 0.0, n=7), 1.0)], seed=1)
    assert [again.task(p) for p in (3999, 5, 17)] == [mix.task(p) for p in (3999, 5, 17)]
    other = EnvMix([(Echo("a", 1.0), 3.0), (Echo("b", 0.0, n=7), 1.0)], seed=2)
    assert [other.task(p).info["env"] for p in range(50)] != picks[:50]
    assert mix.num_tasks() == 17


def test_env_mix_dispatches_rollout_and_score():
    mix = EnvMix([(Echo("a", 1.0), 1.0), (Echo("b", 0.0), 1.0)])
    for position in range(10):
        task = mix.task(position)
        episode, _ = roll(mix, task, ["hello"])
        assert episode.reward == (1.0 if task.info["env"] == "a" else 0.0)
        assert env_name(mix, task) == task.info["env"]
    with pytest.raises(KeyError):
        asyncio.run(mix.score(Task("x", []), Episode(prompt_ids=[1])))
    with pytest.raises(ValueError):
        EnvMix([(Echo("a", 1.0), 1.0), (Echo("a", 0.0), 1.0)])
    with pytest.raises(ValueError):
        EnvMix([(Echo("a", 1.0), 0.0)])


def test_build_envs_single_mix_and_labels():
    single = build_envs([EnvSpec(name="wordle", kwargs={"num_examples": 3})])
    assert single.name == "wordle"
    mix = build_envs(
        [
            EnvSpec(name="reverse_text", weight=2, kwargs={"num_examples": 5}),
            EnvSpec(name="alphabet_sort", kwargs={"num_examples": 5}),
            EnvSpec(
                name="alphabet_sort", label="alphabet_sort_long", kwargs={"num_examples": 5, "max_turns": 4}
            ),
        ],
        seed=0,
    )
    assert isinstance(mix, EnvMix)
    assert sorted(mix.envs) == ["alphabet_sort", "alphabet_sort_long", "reverse_text"]
    with pytest.raises(UserError, match="appear twice"):
        build_envs([EnvSpec(name="math"), EnvSpec(name="math")])
    with pytest.raises(ValueError, match="unknown environment"):
        EnvSpec(name="chess")

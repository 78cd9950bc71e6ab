"""math: word problems whose final answer is checked with `math-verify` (symbolic equivalence, not string match).

Tasks come from a local generator of arithmetic word problems (deterministic, no download: CPU tests and
demos) or from a Hugging Face dataset such as `openai/gsm8k` (GPU runs). The model is asked to put its final
answer in `\\boxed{}`; an unboxed reply is still parsed (math-verify takes the last expression), but scores
only if it is equivalent to the reference.
"""

import random
import re
import threading
from collections.abc import Callable
from typing import Any

from tidal.envs.base import Episode, RewardFn, SingleTurnEnv, Task, completion_text

SYSTEM_PROMPT = "Solve the problem. Think step by step, then give the final answer as \\boxed{answer}."
MAX_ANSWER_CHARS = 10_000  # math-verify on megabytes of model output is slow; nobody's answer is that long

_PEOPLE = ["Ava", "Ben", "Chen", "Dalia", "Emre", "Farah", "Goran", "Hiro", "Isla", "Jamal", "Kofi", "Lena"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cards"]


Problem = tuple[str, int, str]
"""(question, answer, a worked solution that ends in the boxed answer)."""


def _bought_and_gave(rng: random.Random) -> Problem:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    text = f"{who} has {a} {item}. {who} buys {b} more and then gives away {c}. How many {item} does {who} have now?"
    return text, a + b - c, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}."


def _groups(rng: random.Random) -> Problem:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    boxes, per, extra = rng.randint(2, 12), rng.randint(3, 25), rng.randint(0, 9)
    text = f"{who} packs {boxes} boxes with {per} {item} each and has {extra} {item} left over. How many {item} did {who} start with?"
    packed = boxes * per
    return text, packed + extra, f"{boxes} * {per} = {packed}. {packed} + {extra} = {packed + extra}."


def _share(rng: random.Random) -> Problem:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 20)
    text = f"{who} shares {friends * each} {item} equally among {friends} friends. How many {item} does each friend get?"
    return text, each, f"{friends * each} / {friends} = {each}."


def _price(rng: random.Random) -> Problem:
    who = rng.choice(_PEOPLE)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    paid = count * price + rng.randint(0, 50)
    text = f"{who} buys {count} notebooks at {price} dollars each and pays with {paid} dollars. How much change does {who} get, in dollars?"
    cost = count * price
    return text, paid - cost, f"{count} * {price} = {cost}. {paid} - {cost} = {paid - cost}."


_TEMPLATES: list[Callable[[random.Random], Problem]] = [_bought_and_gave, _groups, _share, _price]


def generate_problem(index: int, seed: int) -> tuple[str, str]:
    """(question, answer) number `index` of the local generator."""
    question, answer, _ = generate_worked_problem(index, seed)
    return question, answer


def generate_worked_problem(index: int, seed: int) -> tuple[str, str, str]:
    """(question, answer, worked solution) number `index` of the local generator."""
    rng = random.Random(f"math/{seed}/{index}")
    question, answer, steps = rng.choice(_TEMPLATES)(rng)
    return question, str(answer), f"{steps} \\boxed{{{answer}}}"


def gsm8k_answer(solution: str) -> str:
    """GSM8K solutions end with `#### <answer>`; other datasets give the bare answer."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in solution else solution.strip()


def verify_answer(completion: str, reference: str) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to the reference, else 0.0."""
    from math_verify import parse, verify

    completion = completion[-MAX_ANSWER_CHARS:]
    if not completion.strip():
        return 0.0
    # math-verify's timeouts use signal.alarm, which only works in the main thread
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(_as_boxed(reference), parsing_timeout=limit)  # type: ignore[arg-type]
        answer = parse(completion, parsing_timeout=limit)  # type: ignore[arg-type]
        return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - unparseable output is a wrong answer, not a failed rollout
        return 0.0


def _as_boxed(reference: str) -> str:
    return reference if "\\boxed" in reference else f"\\boxed{{{reference}}}"


def correct_answer(task: Task, episode: Episode) -> float:
    return verify_answer(completion_text(episode), task.answer)


def boxed_format(task: Task, episode: Episode) -> float:
    """Whether the reply has a \\boxed{...} answer at all (logged; weight 0 by default)."""
    return float(re.search(r"\\boxed\{[^{}]*\}", completion_text(episode)) is not None)


class MathEnv(SingleTurnEnv):
    """`dataset = "local"` uses the generator; anything else is a `datasets.load_dataset` id."""

    name = "math"

    def __init__(
        self,
        dataset: str = "local",
        subset: str | None = None,
        split: str = "train",
        question_field: str = "question",
        answer_field: str = "answer",
        num_examples: int | None = None,
        seed: int = 0,
        system_prompt: str = SYSTEM_PROMPT,
    ):
        super().__init__()
        self.system_prompt = system_prompt
        self.seed = seed
        self.solutions: list[str] | None = None
        """Worked solutions of the local generator's rows (a hub dataset's are not kept)."""
        if dataset == "local":
            worked = [generate_worked_problem(i, seed) for i in range(num_examples or 10_000)]
            self.rows = [(question, answer) for question, answer, _ in worked]
            self.solutions = [solution for _, _, solution in worked]
        else:
            self.rows = load_rows(dataset, subset, split, question_field, answer_field, num_examples)
        if not self.rows:
            raise ValueError(f"math: dataset {dataset!r} has no rows")

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(correct_answer, 1.0), (boxed_format, 0.0)]

    def num_tasks(self) -> int:
        return len(self.rows)

    def task(self, index: int) -> Task:
        question, answer = self.rows[index]
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        return Task(task_id=f"math/{index}", messages=messages, answer=answer, info={"index": index})

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The local generator's worked solution; for a hub dataset just the boxed reference answer."""
        index = task.info["index"]
        reply = self.solutions[index] if self.solutions is not None else _as_boxed(task.answer)
        return [*task.messages, {"role": "assistant", "content": reply}]


def load_rows(
    dataset: str, subset: str | None, split: str, question_field: str, answer_field: str, limit: int | None
) -> list[tuple[str, str]]:
    from datasets import load_dataset

    data: Any = load_dataset(dataset, subset, split=split)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    missing = {question_field, answer_field} - set(data.column_names)
    if missing:
        raise ValueError(
            f"math: dataset {dataset} has no column(s) {sorted(missing)} (has {data.column_names})"
        )
    return [(str(row[question_field]), gsm8k_answer(str(row[answer_field]))) for row in data]

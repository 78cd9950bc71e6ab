"""math: problems whose final answer is checked with `math-verify` (symbolic equivalence, not string match).

Tasks come from a local generator (deterministic, no download: CPU tests and demos) or from a Hugging Face
dataset such as `openai/gsm8k` (GPU runs). The local generator has levels (`level`, one name or a list to
mix), so a small real model gets rewards RL can move:
- `arithmetic`: one +, - or × of small numbers ("What is 37 - 12?", 3984 questions); SmolLM2-135M-Instruct
  solves some;
- `products`: two two-digit numbers multiplied ("What is 47 × 23?", 8100 questions): hard for
  Qwen2.5-Coder-0.5B greedy, within reach when sampled;
- `word_problems` (the default): short arithmetic word problems.
The first two write `×`, which real tokenizers know and the tiny char-level test tokenizer does not (it reads
`<unk>`): they are levels for real models.

The prompt asks for the final answer in `\\boxed{}`; a reply without it is still scored, on its final
answer: the text after GSM8K's `####` marker where it has one, else what math-verify finds in the whole
reply (a "The answer is 40" phrase, else the last number), which is what small models write (SmolLM2
almost never boxes). `boxed_format` (weight 0) logs how often replies box.

`split` (local generator): the problems whose question hashes into the held-out bucket, or the others
(`tidal.envs.splits`), each once: a split of a level with fewer questions than `num_examples` starts over
once all are drawn. For a hub dataset `split` is the dataset's split, and `heldout` means its `test`.
"""

import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.envs.base import Episode, RewardFn, SingleTurnEnv, Task, completion_text
from tidal.envs.splits import SplitTasks, check_split

SYSTEM_PROMPT = "Solve the problem. Think step by step, then write the final answer, a number, in \\boxed{}."
ARITHMETIC_PROMPT = "Compute the answer. Write the final answer, a number, in \\boxed{}."
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


def _arithmetic(rng: random.Random) -> Problem:
    """One +, - or × of small numbers (sums and differences up to 50, the times tables to 12 × 20)."""
    operator = rng.choice("+-×")
    if operator == "×":
        a, b = rng.randint(2, 12), rng.randint(2, 20)
        value = a * b
    else:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        if operator == "-":
            a, b = max(a, b), min(a, b)  # no negative answers
        value = a + b if operator == "+" else a - b
    return f"What is {a} {operator} {b}?", value, f"{a} {operator} {b} = {value}."


def _product(rng: random.Random) -> Problem:
    """Two two-digit numbers multiplied; the worked solution splits the second into tens and units."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    tens, units = b - b % 10, b % 10
    steps = f"{a} × {b} = {a} × {tens} + {a} × {units} = {a * tens} + {a * units} = {a * b}."
    return f"What is {a} × {b}?", a * b, steps


LEVELS: dict[str, tuple[str, Callable[[random.Random], Problem]]] = {
    "arithmetic": (ARITHMETIC_PROMPT, _arithmetic),
    "products": (ARITHMETIC_PROMPT, _product),
    "word_problems": (SYSTEM_PROMPT, lambda rng: rng.choice(_TEMPLATES)(rng)),
}
"""Level name → (its system prompt, its problem generator)."""


def generate_problem(index: int, seed: int, level: str = "word_problems") -> tuple[str, str]:
    """(question, answer) number `index` of the local generator."""
    question, answer, _ = generate_worked_problem(index, seed, level)
    return question, answer


def generate_worked_problem(index: int, seed: int, level: str = "word_problems") -> tuple[str, str, str]:
    """(question, answer, worked solution) number `index` of a level of the local generator (word problems
    keep the seed string they always had, so their problems are those of before levels existed)."""
    rng = random.Random(
        f"math/{seed}/{index}" if level == "word_problems" else f"math/{level}/{seed}/{index}"
    )
    question, answer, steps = LEVELS[level][1](rng)
    return question, str(answer), f"{steps} \\boxed{{{answer}}}"


def check_levels(level: str | list[str]) -> list[str]:
    levels = [level] if isinstance(level, str) else list(level)
    unknown = [name for name in levels if name not in LEVELS]
    if not levels or unknown:
        raise ValueError(f"math: level must be one of {', '.join(LEVELS)} or a list of them, got {level!r}")
    return levels


def gsm8k_answer(solution: str) -> str:
    """GSM8K solutions end with `#### <answer>`; other datasets give the bare answer."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in solution else solution.strip()


def verify_answer(completion: str, reference: str) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to the reference, else 0.0."""
    from math_verify import parse, verify

    completion = final_answer_text(completion[-MAX_ANSWER_CHARS:])
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


def final_answer_text(reply: str) -> str:
    """The part of a reply that states its final answer, for math-verify to parse: the whole reply where it
    boxes one (math-verify takes the last box); else the line after a GSM8K-style `####` (SmolLM2 writes
    `#### 98` and then explains, and math-verify alone would take the explanation's last number); else the
    whole reply (math-verify prefers an "answer is ..." phrase, then the last number)."""
    if "\\boxed" in reply or "####" not in reply:
        return reply
    after = reply.rsplit("####", 1)[1].strip()
    return after.splitlines()[0] if after else reply


def _as_boxed(reference: str) -> str:
    return reference if "\\boxed" in reference else f"\\boxed{{{reference}}}"


def correct_answer(task: Task, episode: Episode) -> float:
    return verify_answer(completion_text(episode), task.answer)


def boxed_format(task: Task, episode: Episode) -> float:
    """Whether the reply has a \\boxed{...} answer at all (logged; weight 0 by default)."""
    return float(re.search(r"\\boxed\{[^{}]*\}", completion_text(episode)) is not None)


class MathEnv(SingleTurnEnv):
    """`dataset = "local"` uses the generator at `level` (a name of `LEVELS`, or a list of them: each problem
    from one, drawn evenly); anything else is a `datasets.load_dataset` id. `system_prompt` (None: the
    level's own; the word problems' for a hub dataset) replaces the prompt of every task."""

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
        system_prompt: str | None = None,
        level: str | list[str] = "word_problems",
    ):
        super().__init__()
        self.system_prompt, self.seed = system_prompt, seed
        self.levels = check_levels(level)
        self.local = dataset == "local"
        self.problems = SplitTasks(self._draw, lambda problem: problem.question, split)
        if self.local:
            self.split = check_split(split, "math")
            self.size = num_examples or 10_000
        else:
            self.split = "test" if split == "heldout" else split
            self.rows = load_rows(dataset, subset, self.split, question_field, answer_field, num_examples)
            if not self.rows:
                raise ValueError(f"math: dataset {dataset!r} has no rows")
            self.size = len(self.rows)

    def _draw(self, number: int) -> "LocalProblem":
        level = self.levels[0] if len(self.levels) == 1 else self._level_of(number)
        question, answer, solution = generate_worked_problem(number, self.seed, level)
        return LocalProblem(question, answer, solution, level)

    def _level_of(self, number: int) -> str:
        return random.Random(f"math/levels/{self.seed}/{number}").choice(self.levels)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(correct_answer, 1.0), (boxed_format, 0.0)]

    def num_tasks(self) -> int:
        return self.size

    def task(self, index: int) -> Task:
        if self.local:
            problem = self.problems[index]
            question, answer, prompt = problem.question, problem.answer, LEVELS[problem.level][0]
        else:
            (question, answer), prompt = self.rows[index], SYSTEM_PROMPT
        system = self.system_prompt if self.system_prompt is not None else prompt
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return Task(task_id=f"math/{index}", messages=messages, answer=answer, info={"index": index})

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The local generator's worked solution; for a hub dataset just the boxed reference answer."""
        reply = self.problems[task.info["index"]].solution if self.local else _as_boxed(task.answer)
        return [*task.messages, {"role": "assistant", "content": reply}]


@dataclass(frozen=True)
class LocalProblem:
    """A problem of the local generator: the question, its answer, a worked solution, its level."""

    question: str
    answer: str
    solution: str
    level: str


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

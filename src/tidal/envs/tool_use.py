"""tool_use: arithmetic and counting questions the model answers by calling a calculator or a Python sandbox.

The numbers are large enough that guessing rarely works. Reward: 1.0 for the right number in `<answer>`
tags, plus 0.2 when a tool's output was exactly the answer (`tool_computed_answer`): a real small model
(Qwen2.5-Coder-0.5B) calls the calculator with the right expression but then calls it again and again
instead of answering, and RL needs that step rewarded to get to the next. The tool calls are also logged
(`tools/num_tool_calls`, `tools/num_tool_errors`).

The system prompt's wording is what real models were seen to follow: "Use the tools to compute the
answer" first (an answer format given first, or an example answer, made Qwen2.5-Coder answer at once with
a guess, often the example's number, in every one of 8 tasks; this wording: a tool call in 6 of 6).
`split`: questions whose text hashes into the held-out bucket, or the others (`tidal.envs.splits`).
"""

import random
from dataclasses import dataclass

from tidal.envs.base import Episode, RewardFn, Task, completion_text
from tidal.envs.multiturn import Message
from tidal.envs.sandbox import CALCULATOR, PythonSandbox, python_tool
from tidal.envs.splits import SplitTasks, check_split
from tidal.envs.tools import ToolEnv, tagged_answer, tool_call_text, with_tools

SYSTEM_PROMPT = (
    "Use the tools to compute the answer. After the tool's result comes back, reply <answer>number</answer>."
)


@dataclass(frozen=True)
class Question:
    """A question, its answer, and one tool call that computes it (`tool`, `arguments`)."""

    text: str
    answer: str
    tool: str
    arguments: dict[str, str]


def generate_question(index: int, seed: int) -> tuple[str, str]:
    """(question, answer): products and sums of large numbers, or counts that are easiest in Python."""
    question = make_question(index, seed)
    return question.text, question.answer


def make_question(index: int, seed: int) -> Question:
    """Question `index` of `seed`, with the call that answers it (the calculator where it can, else Python)."""
    rng = random.Random(f"tool_use/{seed}/{index}")
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(1000, 99999), rng.randint(100, 9999), rng.randint(1, 9999)
        expression = f"{a} * {b} - {c}"
        return Question(f"What is {expression}?", str(a * b - c), "calculator", {"expression": expression})
    if kind == 1:
        n = rng.randint(50, 400)
        return Question(
            f"What is the sum of the squares of the integers from 1 to {n}?",
            str(sum(i * i for i in range(1, n + 1))),
            "calculator",
            {"expression": f"{n} * ({n} + 1) * (2 * {n} + 1) // 6"},
        )
    n = rng.randint(100, 2000)
    count = sum(_is_prime[:n])
    code = f"print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))"
    return Question(f"How many prime numbers are smaller than {n}?", str(count), "python", {"code": code})


def _sieve(limit: int) -> list[bool]:
    """`[k is prime for k in range(limit)]`."""
    flags = [k >= 2 for k in range(limit)]
    for k in range(2, int(limit**0.5) + 1):
        if flags[k]:
            flags[k * k :: k] = [False] * len(range(k * k, limit, k))
    return flags


_is_prime = _sieve(2001)


def tool_output(question: Question) -> str:
    """What the tool answers the question's call with: the calculator's value, or what the code prints."""
    return question.answer if question.tool == "calculator" else question.answer + "\n"


def parse_answer(text: str) -> str | None:
    answer = tagged_answer(text)
    return answer.replace(",", "").strip() if answer is not None else None


def correct_answer(task: Task, episode: Episode) -> float:
    answer = parse_answer(completion_text(episode))
    return float(answer is not None and answer == task.answer)


def tool_computed_answer(task: Task, episode: Episode) -> float:
    """1.0 when some tool's whole output was the answer: the model computed it (whether or not it then
    said it). Exactly the output, not a number in it, so printing many numbers earns nothing."""
    outputs = (str(m.get("content", "")).strip() for m in episode.messages if m["role"] == "tool")
    return float(any(output == task.answer for output in outputs))


class ToolUseEnv(ToolEnv):
    """Reward: exact final answer in `<answer>` tags, plus 0.2 when a tool computed it; tools: `calculator`,
    `python` (run in `sandbox`: auto, bwrap or process, see `tidal.envs.sandbox`)."""

    name = "tool_use"
    max_turns = 6

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        python_timeout: float = 5.0,
        python_memory_mb: int = 512,
        sandbox: str = "auto",
        split: str = "train",
    ):
        box = PythonSandbox(timeout=python_timeout, memory_mb=python_memory_mb, mode=sandbox)
        tools = [CALCULATOR, python_tool(box)]
        super().__init__(tools)
        self.tool_timeout = python_timeout + 5.0
        self.num_examples, self.seed, self.split = num_examples, seed, check_split(split, "tool_use")
        self._questions = SplitTasks(self._draw, lambda drawn: drawn[1].text, split)

    def _draw(self, number: int) -> tuple[int, Question]:
        return number, make_question(number, self.seed)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(correct_answer, 1.0), (tool_computed_answer, 0.2)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        number, question = self._questions[index]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question.text}]
        return Task(
            task_id=f"tool_use/{index}", messages=messages, answer=question.answer, info={"draw": number}
        )

    def demonstration(self, task: Task) -> list[Message]:
        """One tool call that computes the answer, the tool's reply, then `<answer>`. The conversation carries
        its tools (`with_tools`): SFT describes them as the rollout's prompt does, by the chat template where
        it renders `tools=`, else in the system message."""
        question = make_question(task.info["draw"], self.seed)
        schemas = [tool.schema() for tool in self.tools.values()]
        return [
            *with_tools(task.messages, schemas),
            {"role": "assistant", "content": tool_call_text(question.tool, question.arguments)},
            {"role": "tool", "content": tool_output(question)},
            {"role": "assistant", "content": f"<answer>{question.answer}</answer>"},
        ]

"""tool_use: arithmetic and counting questions the model answers by calling a calculator or a Python sandbox.

The numbers are large enough that guessing rarely works, so the reward (correct `<answer>`) teaches tool
use; the tool calls themselves are only logged (`tools/num_tool_calls`, `tools/num_tool_errors`).
"""

import random
import re

from tidal.envs.base import Episode, RewardFn, Task, completion_text
from tidal.envs.sandbox import CALCULATOR, PythonSandbox, python_tool
from tidal.envs.tools import ToolEnv

SYSTEM_PROMPT = "Use the tools to compute, then reply <answer>number</answer> without a tool call."
_ANSWER = re.compile(r"<answer>\s*([^<]*?)\s*</answer>", re.IGNORECASE)


def generate_question(index: int, seed: int) -> tuple[str, str]:
    """(question, answer): products and sums of large numbers, or counts that are easiest in Python."""
    rng = random.Random(f"tool_use/{seed}/{index}")
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(1000, 99999), rng.randint(100, 9999), rng.randint(1, 9999)
        return f"What is {a} * {b} - {c}?", str(a * b - c)
    if kind == 1:
        n = rng.randint(50, 400)
        return f"What is the sum of the squares of the integers from 1 to {n}?", str(
            sum(i * i for i in range(1, n + 1))
        )
    n = rng.randint(100, 2000)
    count = sum(1 for k in range(2, n) if all(k % d for d in range(2, int(k**0.5) + 1)))
    return f"How many prime numbers are smaller than {n}?", str(count)


def parse_answer(text: str) -> str | None:
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "").strip() if found else None


def correct_answer(task: Task, episode: Episode) -> float:
    answer = parse_answer(completion_text(episode))
    return float(answer is not None and answer == task.answer)


class ToolUseEnv(ToolEnv):
    """Reward: exact final answer in `<answer>` tags; tools: `calculator`, `python` (run in `sandbox`: auto,
    bwrap or process, see `tidal.envs.sandbox`)."""

    name = "tool_use"
    max_turns = 6

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        python_timeout: float = 5.0,
        python_memory_mb: int = 512,
        sandbox: str = "auto",
    ):
        box = PythonSandbox(timeout=python_timeout, memory_mb=python_memory_mb, mode=sandbox)
        tools = [CALCULATOR, python_tool(box)]
        super().__init__(tools)
        self.tool_timeout = python_timeout + 5.0
        self.num_examples, self.seed = num_examples, seed

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(correct_answer, 1.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        question, answer = generate_question(index, self.seed)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return Task(task_id=f"tool_use/{index}", messages=messages, answer=answer)

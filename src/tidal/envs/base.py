"""The environment interface the orchestrator uses today: tasks in, a reward for a completion out.

Single-turn for now; multi-turn and tool environments extend this protocol (issue: environments and eval).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    """One prompt to roll out: chat messages plus hidden information the reward needs."""

    task_id: str
    messages: list[dict[str, str]]
    answer: str
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """Yields tasks deterministically from a position and scores completions."""

    name: str

    def num_tasks(self) -> int: ...

    def task(self, index: int) -> Task: ...

    def score(self, task: Task, completion: str) -> float: ...


def task_stream(env: Environment, start: int = 0) -> Iterator[tuple[int, Task]]:
    """Endless (position, task) pairs cycling through the environment's tasks."""
    position = start
    while True:
        yield position, env.task(position % env.num_tasks())
        position += 1

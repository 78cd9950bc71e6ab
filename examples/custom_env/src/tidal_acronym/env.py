"""acronym: reply with the first letters of a few words, e.g. "tidal is delightful" -> "TID".

Two environments on the same tasks: `AcronymEnv` (single-turn: one answer) and `AcronymHintsEnv`
(multi-turn: a wrong answer is told which letter is wrong, and the model tries again).
"""

import random

from tidal.envs.base import Episode, RewardFn, SingleTurnEnv, Task, completion_text
from tidal.envs.multiturn import Message, MultiTurnEnv, model_replies

WORDS = ["tidal", "wave", "river", "ocean", "coral", "reef", "kelp", "sand", "foam", "gull", "drift", "shore"]
SYSTEM_PROMPT = "Reply with the acronym of the words: their first letters, in capitals, nothing else."


def make_task(index: int, seed: int, num_words: int) -> Task:
    """Task `index`: `num_words` words drawn by (seed, index), so every run sees the same tasks."""
    rng = random.Random(f"acronym/{seed}/{index}")
    words = [rng.choice(WORDS) for _ in range(num_words)]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": " ".join(words)}]
    return Task(task_id=f"acronym/{index}", messages=messages, answer="".join(w[0] for w in words).upper())


def exact(task: Task, episode: Episode) -> float:
    """1 if the reply is the acronym (spaces and case aside), else 0."""
    return float(normalise(completion_text(episode)) == task.answer)


def letters(task: Task, episode: Episode) -> float:
    """The fraction of the acronym's letters in place: partial credit, so early RL has a signal."""
    reply = normalise(completion_text(episode))
    hits = sum(a == b for a, b in zip(reply, task.answer, strict=False))
    return hits / max(len(reply), len(task.answer))


def normalise(reply: str) -> str:
    return "".join(reply.split()).upper()


class AcronymEnv(SingleTurnEnv):
    """Single-turn: reward = exact match + half the letter accuracy; both logged as reward/<name>."""

    name = "acronym"

    def __init__(self, num_examples: int = 1000, seed: int = 0, num_words: int = 3):
        if num_words < 1:
            raise ValueError(f"num_words must be at least 1, got {num_words}")
        super().__init__()
        self.num_examples, self.seed, self.num_words = num_examples, seed, num_words

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(exact, 1.0), (letters, 0.5)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        return make_task(index, self.seed, self.num_words)

    async def score(self, task: Task, episode: Episode) -> None:
        await super().score(task, episode)
        episode.metrics["reply_chars"] = float(len(completion_text(episode)))  # a metric, not a reward


class AcronymHintsEnv(MultiTurnEnv):
    """Multi-turn: after a wrong answer the environment names the first wrong letter; reward = exact on the
    last answer, minus a little per extra turn."""

    name = "acronym_hints"

    def __init__(self, num_examples: int = 1000, seed: int = 0, num_words: int = 3, max_turns: int = 3):
        super().__init__()
        self.num_examples, self.seed, self.num_words = num_examples, seed, num_words
        self.max_turns = max_turns

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(exact, 1.0), (turn_penalty, 1.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        return make_task(index, self.seed, self.num_words)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        reply = normalise(model_replies(episode)[-1])
        if reply == task.answer:
            return None  # solved: the episode ends
        wrong = next((i for i, (a, b) in enumerate(zip(reply, task.answer, strict=False)) if a != b), None)
        position = min(len(reply), len(task.answer)) if wrong is None else wrong
        episode.info["hints"] = episode.info.get("hints", 0) + 1
        return [{"role": "user", "content": f"Not quite: letter {position + 1} is wrong. Try again."}]


def turn_penalty(task: Task, episode: Episode) -> float:
    return -0.1 * (episode.num_turns - 1)

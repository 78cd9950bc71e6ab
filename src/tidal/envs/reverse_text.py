"""reverse_text: reverse a random lowercase string character by character.

The conversation format is fixed so any tool can evaluate a tidal model on it: system message
`Reverse the text character by character.`, user message = the text, assistant message = the text reversed.
Train and heldout strings come from disjoint halves of string space (by a stable hash), so no heldout string
is ever trained on, whatever the sizes.

    python -m tidal.envs.reverse_text --split heldout --num-examples 200 --out heldout.jsonl
"""

import argparse
import json
import random
import string
from pathlib import Path

from tidal.envs.base import Episode, RewardFn, SingleTurnEnv, Task, completion_text
from tidal.envs.splits import check_split, in_split

SYSTEM_PROMPT = "Reverse the text character by character."
MIN_LEN, MAX_LEN = 3, 10


def generate_texts(split: str, num_examples: int, seed: int = 0) -> list[str]:
    """Deterministic strings of MIN_LEN..MAX_LEN lowercase letters belonging to `split` (by the text itself,
    `tidal.envs.splits`, the rule every built-in environment splits by)."""
    check_split(split, "reverse_text")
    rng = random.Random(f"reverse_text/{seed}/{split}")
    texts: list[str] = []
    while len(texts) < num_examples:
        length = rng.randint(MIN_LEN, MAX_LEN)
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        if in_split(text, split):
            texts.append(text)
    return texts


def conversation(text: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": text},
        {"role": "assistant", "content": text[::-1]},
    ]


def generate_conversations(split: str, num_examples: int, seed: int = 0) -> list[list[dict[str, str]]]:
    return [conversation(text) for text in generate_texts(split, num_examples, seed)]


def char_accuracy(completion: str, target: str) -> float:
    """Position-wise character matches divided by the longer length.

    Dividing by the longer of the two means that dropping or adding characters always costs reward, unlike an
    LCS ratio, which RL learned to game by omitting characters it was unsure of.
    """
    if not completion and not target:
        return 1.0
    matches = sum(a == b for a, b in zip(completion, target, strict=False))
    return matches / max(len(completion), len(target))


class ReverseTextEnv(SingleTurnEnv):
    """reverse_text as an RL environment: reward = position-wise character accuracy (see `char_accuracy`)."""

    name = "reverse_text"

    def __init__(self, num_examples: int = 10_000, seed: int = 0, split: str = "train"):
        super().__init__()
        self._texts = generate_texts(split, num_examples, seed)
        self._order = random.Random(f"reverse_text/order/{seed}").sample(range(num_examples), num_examples)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(reversal_accuracy, 1.0)]

    def num_tasks(self) -> int:
        return len(self._texts)

    def task(self, index: int) -> Task:
        text = self._texts[self._order[index]]
        return Task(task_id=f"reverse_text/{index}", messages=conversation(text)[:2], answer=text[::-1])

    def demonstration(self, task: Task) -> list[dict[str, str]]:
        return [*task.messages, {"role": "assistant", "content": task.answer}]


def reversal_accuracy(task: Task, episode: Episode) -> float:
    return char_accuracy(reversed_text(completion_text(episode)), task.answer)


_EDGES = "`'\"*_.!"


def reversed_text(reply: str) -> str:
    """The reply's answer: its last line that is not a code fence, after a lead-in ending in a colon ("The
    reversed text is: dzwa"), without quotes, backticks, bold or a full stop around it, lower-cased (the
    texts are lower-case letters; SmolLM2 wrote "Awzd." as a sentence). Only the answer is compared, and
    still at every position against the longer of the two, so nothing but the right letters scores."""
    lines = [
        line.strip() for line in reply.splitlines() if line.strip() and not line.strip().startswith("```")
    ]
    if not lines:
        return ""
    answer = lines[-1].rsplit(": ", 1)[-1] if ": " in lines[-1] else lines[-1]
    return answer.strip().strip(_EDGES).strip().lower()


def main() -> None:
    parser = argparse.ArgumentParser(description="Write reverse_text conversations as JSONL.")
    parser.add_argument("--split", choices=["train", "heldout"], default="train")
    parser.add_argument("--num-examples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as fh:
        for messages in generate_conversations(args.split, args.num_examples, args.seed):
            fh.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.num_examples} {args.split} conversations to {args.out}")


if __name__ == "__main__":
    main()

"""alphabet_sort: sort names alphabetically, then keep the list sorted as new names arrive each turn.

Turn 1 gives a few names; each later user turn adds more, and the model must answer every turn with the
whole list so far, sorted, one name per line. Each turn is scored by position-wise agreement with the
expected list divided by the longer length (dropping or inventing names always costs), and the reward is
the mean over turns, so a rollout that gets the first turn right and then drifts earns partial credit.
"""

import random
import re
from dataclasses import replace

from tidal.envs.base import Episode, RewardFn, Task
from tidal.envs.multiturn import Message, MultiTurnEnv, model_replies
from tidal.envs.splits import SplitTasks, check_split

SYSTEM_PROMPT = (
    "Sort the names alphabetically and answer with the sorted list, one name per line, nothing else. "
    "When more names arrive, answer with the whole list so far, still sorted."
)

_NAMES_TEXT = (
    "Ada Alan Alma Amir Anya Arlo Aria Axel Beau Bela Bodhi Boris Cara Cato Cleo Dara Dario Dev Dina Eero "
    "Elio Elsa Emil Enzo Esme Ezra Faye Finn Flora Gael Gia Gus Hana Hugo Ida Ines Ira Ivo Jada Jiro Jonas "
    "Juno Kai Kira Lars Lea Leon Lina Lotte Luca Mara Milo Mina Nadia Nico Noor Odin Olga Omar Otto Paz Pia "
    "Quinn Rafa Rhea Rosa Rumi Sami Sana Saul Tara Teo Thea Umar Una Vera Vik Wren Xena Yara Yuri Zara Zeno"
)
NAMES = _NAMES_TEXT.split()


def make_task(index: int, seed: int, num_turns: tuple[int, int], names_per_turn: tuple[int, int]) -> Task:
    """Task `index`: `info["turns"]` holds the names added at each turn."""
    rng = random.Random(f"alphabet_sort/{seed}/{index}")
    turns = rng.randint(*num_turns)
    counts = [rng.randint(*names_per_turn) for _ in range(turns)]
    chosen = rng.sample(NAMES, sum(counts))
    batches, start = [], 0
    for count in counts:
        batches.append(chosen[start : start + count])
        start += count
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": ", ".join(batches[0])},
    ]
    answer = "\n".join(sorted(chosen, key=str.lower))
    return Task(task_id=f"alphabet_sort/{index}", messages=messages, answer=answer, info={"turns": batches})


def split_key(task: Task) -> str:
    """What makes a task that task, for the train/held-out split: the names to sort (however they arrive),
    so no set of names is both trained on and held out."""
    return ", ".join(sorted(name for batch in task.info["turns"] for name in batch))


def expected_lists(task: Task) -> list[list[str]]:
    """The sorted list the model should give after each turn."""
    seen: list[str] = []
    out = []
    for batch in task.info["turns"]:
        seen = seen + list(batch)
        out.append(sorted(seen, key=str.lower))
    return out


_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s*")
_SEPARATORS = re.compile(r",|\n|\band\b")
_EDGES = "*_`'\".;:!?()[]"


def parse_names(text: str) -> list[str]:
    """Names from a reply: one per line (commas and "and" also split), bullets, numbering, markdown and
    trailing full stops removed; a lead-in before a colon ("Here is the sorted list:") and pieces of prose
    dropped. Real replies: SmolLM2-135M wrote "The names are:\n\nJada, Cato, Vik, Jiro, Olga", with the
    lead-in counted as a name every position after it was wrong; Qwen2.5-Coder-0.5B wrote one comma line.

    A piece of one word is a name (a wrong one costs, as a missing one does); a piece of several words is a
    name list only if every word is capitalised ("Ada Bela Cara"), else prose, which names nothing."""
    names = []
    for piece in _SEPARATORS.split(text):
        piece = _BULLET.sub("", piece)
        if ":" in piece:
            piece = piece.rsplit(":", 1)[1]
        words = [word for word in (w.strip(_EDGES) for w in piece.split()) if word]
        if len(words) == 1 or all(word[:1].isupper() and word.isalpha() for word in words):
            names += words
    return names


def list_agreement(got: list[str], want: list[str]) -> float:
    if not got and not want:
        return 1.0
    matches = sum(a.lower() == b.lower() for a, b in zip(got, want, strict=False))
    return matches / max(len(got), len(want))


def sorted_agreement(task: Task, episode: Episode) -> float:
    """Mean over the task's turns of each reply's agreement with the expected list (missing turns score 0)."""
    want = expected_lists(task)
    replies = model_replies(episode)
    scores = [list_agreement(parse_names(r), w) for r, w in zip(replies, want, strict=False)]
    return sum(scores) / len(want)


def all_turns_exact(task: Task, episode: Episode) -> float:
    want = expected_lists(task)
    replies = model_replies(episode)
    exact = len(replies) >= len(want) and all(
        list_agreement(parse_names(r), w) == 1.0 for r, w in zip(replies, want, strict=False)
    )
    return float(exact)


class AlphabetSortEnv(MultiTurnEnv):
    """Reward: `sorted_agreement`; `all_turns_exact` is logged with weight 0."""

    name = "alphabet_sort"

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        min_turns: int = 1,
        max_turns: int = 3,
        min_names: int = 2,
        max_names: int = 4,
        split: str = "train",
    ):
        if not 1 <= min_turns <= max_turns or not 1 <= min_names <= max_names:
            raise ValueError("alphabet_sort: need 1 ≤ min_turns ≤ max_turns and 1 ≤ min_names ≤ max_names")
        if max_turns * max_names > len(NAMES):
            raise ValueError(f"alphabet_sort: at most {len(NAMES)} names in one task")
        super().__init__()
        self.num_examples, self.seed = num_examples, seed
        self.turn_range, self.name_range = (min_turns, max_turns), (min_names, max_names)
        self.max_turns = max_turns
        self.split = check_split(split, "alphabet_sort")
        self._tasks = SplitTasks(self._draw, split_key, split)

    def _draw(self, number: int) -> Task:
        return make_task(number, self.seed, self.turn_range, self.name_range)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(sorted_agreement, 1.0), (all_turns_exact, 0.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        return replace(self._tasks[index], task_id=f"alphabet_sort/{index}")

    def demonstration(self, task: Task) -> list[Message]:
        """Every turn answered with the sorted list so far; the names of the next turn in between."""
        messages: list[Message] = [dict(m) for m in task.messages]
        for turn, names in enumerate(expected_lists(task)):
            if turn > 0:
                messages.append(add_names_message(task.info["turns"][turn]))
            messages.append({"role": "assistant", "content": "\n".join(names)})
        return messages

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        batches = task.info["turns"]
        if episode.num_turns >= len(batches):
            return None
        return [add_names_message(batches[episode.num_turns])]


def add_names_message(names: list[str]) -> Message:
    """The user turn that adds `names` to the list."""
    return {"role": "user", "content": "Add: " + ", ".join(names)}

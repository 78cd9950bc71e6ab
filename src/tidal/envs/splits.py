"""Train and held-out splits of the built-in environments: one stable rule, and the distinct tasks of a split.

A task is held out when the crc32 of its split key (what makes it that task: a wordle secret, a math
question, the names to sort, a code task's id) falls in one bucket of ten. The rule reads nothing else (not
the seed, the index or the prompt's wording), so the held-out tasks that `tidal rl` evaluates online and the
held-out demonstrations that `tidal sft` evaluates on are one set, and no held-out task is ever trained on.
"""

import zlib
from collections.abc import Callable
from typing import Generic, TypeVar

SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 10
MAX_MISSES = 20_000
"""Draws in a row that bring no new task of the split before `SplitTasks` takes the split as exhausted."""

T = TypeVar("T")


def check_split(split: str, env: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"{env}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split


def is_heldout(key: str) -> bool:
    return zlib.crc32(key.encode()) % HELDOUT_BUCKETS == 0


def in_split(key: str, split: str) -> bool:
    return is_heldout(key) == (split == "heldout")


class SplitTasks(Generic[T]):
    """The distinct items of one split of a generator, in generator order: item `i` is the `i`-th draw whose
    key is in the split and was not drawn before (so the first N held-out tasks are N different tasks).

    Draws are made lazily, in order, so item `i` is the same whichever items were asked for before. When
    `max_misses` draws in a row bring nothing new the split's task space is taken as exhausted (a small
    one, such as two-digit products) and later positions wrap round to its start.
    """

    def __init__(
        self, draw: Callable[[int], T], key: Callable[[T], str], split: str, max_misses: int = MAX_MISSES
    ):
        self.draw, self.key, self.split, self.max_misses = draw, key, split, max_misses
        self.items: list[T] = []
        self._seen: set[str] = set()
        self._next_draw = 0
        self.exhausted = False

    def __getitem__(self, position: int) -> T:
        while len(self.items) <= position and not self.exhausted:
            self._add_one()
        if not self.items:
            raise ValueError(f"no task of the {self.split} split in {self.max_misses} draws")
        return self.items[position % len(self.items)]

    def _add_one(self) -> None:
        for _ in range(self.max_misses):
            item = self.draw(self._next_draw)
            self._next_draw += 1
            key = self.key(item)
            if key not in self._seen and in_split(key, self.split):
                self._seen.add(key)
                self.items.append(item)
                return
        self.exhausted = True

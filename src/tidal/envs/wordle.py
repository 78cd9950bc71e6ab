"""wordle: guess a hidden five-letter word in at most six guesses, with per-letter feedback after each.

The model writes its guess as `<guess>crane</guess>`; the environment answers with the feedback, one symbol
per letter: `G` right letter in the right place, `Y` in the word elsewhere, `-` not in the word (repeated
letters are only marked as often as they occur in the hidden word, as in the real game). Any five letters
are a valid guess (no dictionary), so the model cannot be stuck on an unknown-word loop. Every example in a
prompt is a valid guess: small models copy it (a `<guess>word</guess>` example was copied, four letters,
invalid every turn).

The hidden words are `data/wordle_words.json` (2168 real English words). A split holds the words whose
hash puts them there (`tidal.envs.splits`: 226 held out, 1942 to train on), so a held-out game's word is
never trained on; task `i` of a split plays its words in a shuffled order, each once before any repeats,
so the first 226 held-out games are 226 different words.
"""

import functools
import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np

from tidal.envs.base import Episode, RewardFn, Task, answer_text
from tidal.envs.multiturn import Message, MultiTurnEnv
from tidal.envs.splits import check_split, in_split

MAX_GUESSES = 6
EXAMPLE_GUESS = "<guess>crane</guess>"
SYSTEM_PROMPT = (
    f"Let's play Wordle. Guess the hidden five-letter word. Write each guess like {EXAMPLE_GUESS}. After each "
    "guess you get one symbol per letter: G = right letter, right place; Y = in the word, wrong place; - = not "
    f"in the word. You have {MAX_GUESSES} guesses."
)
WORDS_FILE = Path(__file__).with_name("data") / "wordle_words.json"
WORDS: list[str] = json.loads(WORDS_FILE.read_text())["words"]

_GUESS = re.compile(r"<guess>\s*([^<]*?)\s*</guess>", re.IGNORECASE)
_LONE_WORD = re.compile(r"[*_`\"'\s]*([A-Za-z]{5})[*_`\"'\s.!]*")


def feedback(guess: str, secret: str) -> str:
    """G/Y/- per letter, marking repeated letters only as often as the secret holds them."""
    marks = ["-"] * len(secret)
    unmatched = Counter(s for g, s in zip(guess, secret, strict=True) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = "G"
        elif unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


@functools.lru_cache(maxsize=4096)
def solver_guesses(secret: str, words: tuple[str, ...]) -> tuple[str, ...]:
    """The guesses of a fixed strategy until it finds `secret` (which must be in `words`): each guess is the
    word still possible whose worst feedback leaves the fewest words possible (ties: the earlier word), so
    every game of one word list opens the same way."""
    table = feedback_table(words)
    target = words.index(secret)
    history: tuple[int, ...] = ()
    guesses: list[str] = []
    while True:
        guess = _solver_guess(words, history)
        guesses.append(words[guess])
        if guess == target:
            return tuple(guesses)
        history += (int(table[guess, target]),)


@functools.lru_cache(maxsize=65536)
def _solver_guess(words: tuple[str, ...], history: tuple[int, ...]) -> int:
    """The solver's guess after the feedback codes `history` (cached: all games share their first moves)."""
    return _minimax_guess(feedback_table(words), _still_possible(words, history))


@functools.lru_cache(maxsize=65536)
def _still_possible(words: tuple[str, ...], history: tuple[int, ...]) -> np.ndarray:
    """Indices of the words that every feedback of `history` (to the solver's guesses) leaves possible."""
    if not history:
        return np.arange(len(words))
    before = _still_possible(words, history[:-1])
    guess = _solver_guess(words, history[:-1])
    return before[feedback_table(words)[guess, before] == history[-1]]


def _minimax_guess(table: np.ndarray, possible: np.ndarray) -> int:
    codes = table[np.ix_(possible, possible)].astype(np.int64)  # [guess, secret], both still possible
    rows = codes + NUM_CODES * np.arange(len(possible))[:, None]
    counts = np.bincount(rows.ravel(), minlength=NUM_CODES * len(possible)).reshape(len(possible), NUM_CODES)
    return int(possible[np.argmin(counts.max(axis=1))])  # argmin: the first of equals, the earlier word


NUM_CODES = 3**5
_BLOCK = 64


@functools.lru_cache(maxsize=4)
def feedback_table(words: tuple[str, ...]) -> np.ndarray:
    """[guess, secret] → `feedback(guess, secret)` as a base-3 number (`-` 0, `Y` 1, `G` 2 per letter):
    the solver's table, built with array operations a block of guesses at a time."""
    letters = np.array([[ord(c) for c in word] for word in words], dtype=np.int16)  # [n, 5]
    table = np.empty((len(words), len(words)), dtype=np.uint8)
    for start in range(0, len(words), _BLOCK):
        table[start : start + _BLOCK] = _feedback_codes(letters[start : start + _BLOCK], letters)
    return table


def _feedback_codes(guesses: np.ndarray, secrets: np.ndarray) -> np.ndarray:
    """[guess, secret] codes of `feedback` for arrays of letters ([g, 5] and [s, 5])."""
    green = guesses[:, None, :] == secrets[None, :, :]  # [g, s, 5]
    spare = ~green  # positions not matched in place
    # available[g, s, i]: letters of the secret equal to guess letter i, not matched in place
    equal = guesses[:, None, :, None] == secrets[None, :, None, :]  # [g, s, i, k]
    available = (equal & spare[:, :, None, :]).sum(-1, dtype=np.uint8)
    # earlier[g, s, i]: earlier guess letters equal to letter i, not in place, which claim a match first
    same_before = (guesses[:, :, None] == guesses[:, None, :]) & np.tri(5, k=-1, dtype=bool)  # [g, i, j]
    earlier = (spare[:, :, None, :] & same_before[:, None, :, :]).sum(-1, dtype=np.uint8)
    yellow = spare & (available > earlier)
    return ((2 * green + yellow) * 3 ** np.arange(5)).sum(-1).astype(np.uint8)


def split_key(secret: str) -> str:
    """What makes a game that game, for the train/held-out split: its hidden word."""
    return secret


def feedback_message(guess: str, marks: str, left: int) -> str:
    """The user turn that answers a well-formed guess that did not win."""
    return f"{guess.upper()} {marks} ({left} guesses left)"


def parse_guess(text: str) -> str | None:
    """The last `<guess>` of the reply, lower-cased, if it is exactly five letters; without tags, a reply
    that is one five-letter word and nothing else (`CRANE`, `**crane**`), which models also write. A word
    inside prose is no guess: "Guess the five-letter word." must not play GUESS."""
    found = _GUESS.findall(text)
    lone = _LONE_WORD.fullmatch(text)
    guess = found[-1].strip().lower() if found else lone.group(1).lower() if lone else ""
    return guess if len(guess) == 5 and guess.isascii() and guess.isalpha() else None


def solved(task: Task, episode: Episode) -> float:
    return float(episode.info.get("solved", False))


def best_greens(task: Task, episode: Episode) -> float:
    """Fraction of letters placed right in the best guess: a dense signal before the model can win."""
    marks = episode.info.get("feedback", [])
    return max((m.count("G") / 5 for m in marks), default=0.0)


def valid_guesses(task: Task, episode: Episode) -> float:
    """Share of turns with a well-formed guess (logged; weight 0 by default)."""
    turns = episode.info.get("num_guesses", 0)
    return (turns - episode.info.get("num_invalid", 0)) / turns if turns else 0.0


class WordleEnv(MultiTurnEnv):
    """Reward: solved (1.0) plus 0.2 × best_greens; each guess is one model turn.

    `split`: the words of the train or the held-out split (`tidal.envs.splits`, by the word itself); task `i`
    is the `i % n`-th of the split's n words in the order of shuffle `i // n` of `seed`. `words`: another
    list of hidden words (the solver's demonstrations guess from it too)."""

    name = "wordle"
    max_turns = MAX_GUESSES

    def __init__(
        self, num_examples: int = 10_000, seed: int = 0, words: list[str] | None = None, split: str = "train"
    ):
        super().__init__()
        self.words = [w.lower() for w in (words or WORDS)]
        if any(len(w) != 5 or not w.isascii() or not w.isalpha() for w in self.words):
            raise ValueError("wordle: every word must have exactly five letters")
        self.split = check_split(split, "wordle")
        self.secrets = [w for w in dict.fromkeys(self.words) if in_split(split_key(w), split)]
        if not self.secrets:
            raise ValueError(f"wordle: no word of the {len(self.words)} given is in the {split} split")
        self.num_examples, self.seed = num_examples, seed
        self._rounds: dict[int, list[str]] = {}

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(solved, 1.0), (best_greens, 0.2), (valid_guesses, 0.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        secret = self._round(index // len(self.secrets))[index % len(self.secrets)]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Make your first guess."},
        ]
        return Task(task_id=f"wordle/{index}", messages=messages, answer=secret)

    def _round(self, number: int) -> list[str]:
        """The split's words in the order of round `number`: every word once per round."""
        if number not in self._rounds:
            rng = random.Random(f"wordle/{self.seed}/{self.split}/{number}")
            self._rounds[number] = rng.sample(self.secrets, len(self.secrets))
        return self._rounds[number]

    def setup_episode(self, task: Task, episode: Episode) -> None:
        episode.info.update(solved=False, feedback=[], num_guesses=0, num_invalid=0)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        info = episode.info
        info["num_guesses"] += 1
        guess = parse_guess(answer_text(str(episode.messages[-1]["content"])))
        left = MAX_GUESSES - info["num_guesses"]
        if guess is None:
            info["num_invalid"] += 1
            text = f"Invalid guess: write one five-letter word in guess tags, like {EXAMPLE_GUESS}. ({left} guesses left)"
        else:
            marks = feedback(guess, task.answer)
            info["feedback"].append(marks)
            if marks == "GGGGG":
                info["solved"] = True
                return None
            text = feedback_message(guess, marks, left)
        return [{"role": "user", "content": text}] if left > 0 else None

    def demonstration(self, task: Task) -> list[Message] | None:
        """A game won by `solver_guesses` (None when it needs more than six guesses for this word)."""
        guesses = solver_guesses(task.answer, tuple(self.words))
        if len(guesses) > MAX_GUESSES:
            return None
        messages: list[Message] = [dict(m) for m in task.messages]
        for number, guess in enumerate(guesses):
            if number > 0:
                previous = guesses[number - 1]
                text = feedback_message(previous, feedback(previous, task.answer), MAX_GUESSES - number)
                messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": f"<guess>{guess}</guess>"})
        return messages

    async def score(self, task: Task, episode: Episode) -> None:
        await super().score(task, episode)
        episode.metrics["wordle/num_guesses"] = float(episode.info.get("num_guesses", 0))

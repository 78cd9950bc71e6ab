"""wordle: guess a hidden five-letter word in at most six guesses, with per-letter feedback after each.

The model writes its guess as `<guess>word</guess>`; the environment answers with the feedback, one symbol
per letter: `G` right letter in the right place, `Y` in the word elsewhere, `-` not in the word (repeated
letters are only marked as often as they occur in the hidden word, as in the real game). Any five letters
are a valid guess (no dictionary), so the model cannot be stuck on an unknown-word loop.
"""

import functools
import random
import re
from collections import Counter

from tidal.envs.base import Episode, RewardFn, Task, answer_text
from tidal.envs.multiturn import Message, MultiTurnEnv

MAX_GUESSES = 6
SYSTEM_PROMPT = (
    "Let's play Wordle. Guess the hidden five-letter word. Write each guess as <guess>word</guess>. "
    "After each guess you get one symbol per letter: G = right letter, right place; Y = in the word, "
    f"wrong place; - = not in the word. You have {MAX_GUESSES} guesses."
)

_WORDS_TEXT = (
    "about above acorn actor adapt admit adopt agent agree alarm album alert alive allow alone alpha angle "
    "apple april arena argue arise array aside asset audio avoid award aware badge baker basic beach began "
    "begin being below bench berry birth black blade blame blank blast blend blind block bloom board boost "
    "brain brand brave bread break brick brief bring broad brown brush build burst cabin cable candy cargo "
    "carry catch cause chain chair chalk charm chart chase cheap check chess chest chief child civic claim "
    "class clean clear climb clock close cloud coach coast color coral couch count court cover craft crane "
    "cream crisp crowd crown curve cycle daily dance delta depth diary digit dough draft drama dream dress "
    "drink drive eager early earth eight elbow elder empty enjoy entry equal error event exact extra fable "
    "faith false fancy feast fence field final flame flash fleet float flour focus forge frame fresh front "
    "fruit giant glass globe glove grace grain grape graph grass green guard guest guide habit happy heart "
    "honey horse hotel house human humor ideal image index inner input issue ivory jelly jewel joint judge "
    "juice knife label laser laugh layer lemon level light limit linen logic lunar magic major maple march "
    "match medal metal minor model money month motor mount music nerve night noble north novel ocean olive "
    "onion opera orbit order other ounce owner paint panel paper party peace pearl phase piano pilot pitch "
    "plain plane plant plate point polar power press price pride prime print prize proof proud pulse queen "
    "quiet radio raise range rapid raven reach ready relax river robot rocky round royal ruler salad sauce "
    "scale scene scout shade shape share shelf shell shine shirt short sight skill slice smile smoke solar "
    "solid sound south space spark spice spoon sport staff stage stair stamp stand steam steel stone storm "
    "story sugar sunny swift table teach theme thumb tiger toast topic torch total tower trace track trade "
    "train treat trend trial trust truth tulip uncle union unity urban usual valid value vapor video vivid "
    "vocal voice waste watch water whale wheat wheel white whole woman world worth yield young youth zebra"
)
WORDS = _WORDS_TEXT.split()

_GUESS = re.compile(r"<guess>\s*([^<]*?)\s*</guess>", re.IGNORECASE)


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
    possible = words
    guesses: list[str] = []
    while True:
        guess = _minimax_guess(possible)
        guesses.append(guess)
        if guess == secret:
            return tuple(guesses)
        marks = feedback(guess, secret)
        possible = tuple(w for w in possible if feedback(guess, w) == marks)


@functools.lru_cache(maxsize=4096)
def _minimax_guess(possible: tuple[str, ...]) -> str:
    def worst(guess: str) -> int:
        return max(Counter(feedback(guess, w) for w in possible).values())

    return min(possible, key=worst)


def feedback_message(guess: str, marks: str, left: int) -> str:
    """The user turn that answers a well-formed guess that did not win."""
    return f"{guess.upper()} {marks} ({left} guesses left)"


def parse_guess(text: str) -> str | None:
    """The last `<guess>` of the reply, lower-cased, if it is exactly five letters."""
    found = _GUESS.findall(text)
    if not found:
        return None
    guess = found[-1].strip().lower()
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
    """Reward: solved (1.0) plus 0.2 × best_greens; each guess is one model turn."""

    name = "wordle"
    max_turns = MAX_GUESSES

    def __init__(self, num_examples: int = 10_000, seed: int = 0, words: list[str] | None = None):
        super().__init__()
        self.words = [w.lower() for w in (words or WORDS)]
        if any(len(w) != 5 or not w.isalpha() for w in self.words):
            raise ValueError("wordle: every word must have exactly five letters")
        self.num_examples, self.seed = num_examples, seed

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(solved, 1.0), (best_greens, 0.2), (valid_guesses, 0.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        secret = random.Random(f"wordle/{self.seed}/{index}").choice(self.words)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Make your first guess."},
        ]
        return Task(task_id=f"wordle/{index}", messages=messages, answer=secret)

    def setup_episode(self, task: Task, episode: Episode) -> None:
        episode.info.update(solved=False, feedback=[], num_guesses=0, num_invalid=0)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        info = episode.info
        info["num_guesses"] += 1
        guess = parse_guess(answer_text(str(episode.messages[-1]["content"])))
        left = MAX_GUESSES - info["num_guesses"]
        if guess is None:
            info["num_invalid"] += 1
            text = f"Invalid guess: write exactly five letters as <guess>word</guess>. ({left} guesses left)"
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

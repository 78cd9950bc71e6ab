"""shapes: questions about a drawn picture of coloured shapes, exactly verifiable (the visual environment).

Each task is a picture drawn with Pillow: a few shapes (circle, square, triangle) on a white canvas, in
colours that may repeat, one per cell of a grid, so nothing overlaps and every count is exact. The user
message holds the picture as an OpenAI content part (`image_url` with a PNG data URL) and a question: how many shapes of a
colour, how many of a kind, or what colour the one shape of a kind is. Later user turns ask more questions
about the same picture (`max_turns` > 1: multi-turn), or with `new_pictures` each shows a new picture and
asks about that one (pictures added by an environment's turns). The reward is the share of turns whose reply ends
with the right answer (a number, or a colour word).

Tasks are generated from (seed, index), so each split is reproducible without a dataset file; the held-out
split holds out whole pictures (the split key is the scene), never a question about a trained picture.
"""

import io
import random
import re
from dataclasses import dataclass, replace
from typing import Any

from tidal.envs.base import Episode, RewardFn, Task
from tidal.envs.chat import png_data_url
from tidal.envs.multiturn import Message, MultiTurnEnv, model_replies
from tidal.envs.splits import SplitTasks, check_split

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
KINDS = ("circle", "square", "triangle")
SYSTEM_PROMPT = (
    "Answer each question about the picture with one word or one number and nothing else: a count as a "
    "number (for example 2), a colour as its name (for example red)."
)
NUMBER_WORDS = {"zero": 0, "none": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cell: int
    """Index of its grid cell, row-major."""


def draw_scene(rng: random.Random, grid: int, min_shapes: int, max_shapes: int) -> list[Shape]:
    """Shapes in distinct cells; a colour may repeat (counting by colour has answers above 1)."""
    count = rng.randint(min_shapes, max_shapes)
    cells = sorted(rng.sample(range(grid * grid), count))
    return [Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), cell) for cell in cells]


def questions(scene: list[Shape]) -> list[tuple[str, str]]:
    """Every (question, answer) the scene answers exactly, in a fixed order."""
    asked: list[tuple[str, str]] = []
    for colour in COLOURS:
        n = sum(s.colour == colour for s in scene)
        asked.append((f"How many {colour} shapes are in the picture?", str(n)))
    for kind in KINDS:
        of_kind = [s for s in scene if s.kind == kind]
        asked.append((f"How many {kind}s are in the picture?", str(len(of_kind))))
        if len(of_kind) == 1:
            asked.append((f"What colour is the {kind}?", of_kind[0].colour))
    return asked


def render_png(scene: list[Shape], grid: int, size: int) -> bytes:
    """The scene as a PNG: each shape inset in its cell so that neighbours never touch."""
    from PIL import Image, ImageDraw  # Pillow: imported where a picture is drawn

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell = size / grid
    pad = cell * 0.15
    for shape in scene:
        row, col = divmod(shape.cell, grid)
        x0, y0 = col * cell + pad, row * cell + pad
        x1, y1 = (col + 1) * cell - pad, (row + 1) * cell - pad
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_message(url: str, text: str) -> Message:
    """A user message with one picture and a question, as OpenAI content parts."""
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


def make_task(
    index: int,
    seed: int,
    turns: tuple[int, int],
    grid: int,
    size: int,
    shapes: tuple[int, int],
    new_pictures: bool = False,
) -> Task:
    """Task `index`: a scene and 1..max_turns of its questions (distinct), the first in the picture's
    message; `info["qa"]` holds every turn's (question, answer), `info["scene"]` the shapes. `new_pictures`:
    each later turn has a scene of its own and one question about it, its picture in `info["pictures"]`
    (a PNG data URL per later turn) and its shapes in `info["later_scenes"]`."""
    rng = random.Random(f"shapes/{seed}/{index}")
    scene = draw_scene(rng, grid, *shapes)
    pool = questions(scene)
    count = rng.randint(*turns)
    asked = rng.sample(pool, 1 if new_pictures else min(len(pool), count))
    url = png_data_url(render_png(scene, grid, size))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, image_message(url, asked[0][0])]
    info: dict[str, Any] = {"qa": asked, "scene": [(s.kind, s.colour, s.cell) for s in scene], "grid": grid}
    if new_pictures:
        later = [draw_scene(rng, grid, *shapes) for _ in range(count - 1)]
        asked += [rng.choice(questions(other)) for other in later]
        info["pictures"] = [png_data_url(render_png(other, grid, size)) for other in later]
        info["later_scenes"] = [[(s.kind, s.colour, s.cell) for s in other] for other in later]
    return Task(task_id=f"shapes/{index}", messages=messages, answer=asked[-1][1], info=info)


def split_key(task: Task) -> str:
    """The scene (kinds, colours and places on its grid): a held-out picture is never trained on (with
    `new_pictures`, the first picture decides, as it does the first question)."""
    return f"{task.info['grid']}:" + ";".join(f"{k},{c},{cell}" for k, c, cell in task.info["scene"])


_WORD = re.compile(r"[a-z]+|\d+")


def parse_answer(text: str, number: bool) -> str | None:
    """The last number (digits, or a number word up to six) of a reply to a count question (`number`), or
    its last colour name: "There are 2 red shapes." answers a count with 2, "The square is red." a colour."""
    for word in reversed(_WORD.findall(text.lower())):
        if number and word.isdigit():
            return str(int(word))
        if number and word in NUMBER_WORDS:
            return str(NUMBER_WORDS[word])
        if not number and word in COLOURS:
            return word
    return None


def turns_correct(task: Task, episode: Episode) -> float:
    """The share of the task's questions whose reply ends with the right answer (missing turns score 0)."""
    answers = [answer for _, answer in task.info["qa"]]
    replies = model_replies(episode)
    right = sum(
        parse_answer(reply, answer.isdigit()) == answer
        for reply, answer in zip(replies, answers, strict=False)
    )
    return right / len(answers)


class ShapesEnv(MultiTurnEnv):
    """Reward: `turns_correct`. `min_turns = max_turns = 1` (the default) is single-turn."""

    name = "shapes"
    gives_images = True

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        min_turns: int = 1,
        max_turns: int = 1,
        grid: int = 3,
        image_size: int = 112,
        min_shapes: int = 2,
        max_shapes: int = 5,
        split: str = "train",
        new_pictures: bool = False,
    ):
        if not 1 <= min_turns <= max_turns:
            raise ValueError("shapes: need 1 ≤ min_turns ≤ max_turns")
        if not 2 <= grid <= 6 or not 1 <= min_shapes <= max_shapes <= grid * grid:
            raise ValueError("shapes: need 2 ≤ grid ≤ 6 and 1 ≤ min_shapes ≤ max_shapes ≤ grid²")
        if not 28 <= image_size <= 1024:
            raise ValueError(f"shapes: image_size must be within 28..1024 pixels, got {image_size}")
        super().__init__()
        self.num_examples, self.seed, self.max_turns = num_examples, seed, max_turns
        self.settings = ((min_turns, max_turns), grid, image_size, (min_shapes, max_shapes), new_pictures)
        self.split = check_split(split, "shapes")
        self._tasks = SplitTasks(self._draw, split_key, split)

    def _draw(self, number: int) -> Task:
        turns, grid, size, shapes, new_pictures = self.settings
        return make_task(number, self.seed, turns, grid, size, shapes, new_pictures)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(turns_correct, 1.0)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        return replace(self._tasks[index], task_id=f"shapes/{index}")

    def demonstration(self, task: Task) -> list[Message]:
        """Every question answered; later questions as the environment asks them."""
        messages: list[Message] = [dict(m) for m in task.messages]
        for turn, (_, answer) in enumerate(task.info["qa"]):
            if turn > 0:
                messages.append(self._question(task, turn))
            messages.append({"role": "assistant", "content": answer})
        return messages

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        if episode.num_turns >= len(task.info["qa"]):
            return None
        return [self._question(task, episode.num_turns)]

    @staticmethod
    def _question(task: Task, turn: int) -> Message:
        """Later turn `turn`'s user message: its question, with its own picture under `new_pictures`."""
        question = task.info["qa"][turn][0]
        pictures = task.info.get("pictures")
        return (
            image_message(pictures[turn - 1], question) if pictures else {"role": "user", "content": question}
        )

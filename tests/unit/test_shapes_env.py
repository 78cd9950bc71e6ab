"""The visual environment `shapes`: the picture shows what the answers say, replies are parsed as models write
them, splits hold out whole pictures, and every command refuses it until the image path exists."""

import base64
import io

import pytest
from PIL import Image

from tidal.config.common import BuiltinDataset
from tidal.config.envs import EnvSpec
from tidal.config.rl import OrchestratorConfig
from tidal.envs.base import Episode
from tidal.envs.chat import message_images
from tidal.envs.registry import build_env, check_env
from tidal.envs.shapes import COLOURS, ShapesEnv, parse_answer, split_key, turns_correct
from tidal.errors import UserError
from tidal.orchestrator.loop import build_env as orchestrator_env
from tidal.trainer.sources import load_conversations


def _picture(task) -> Image.Image:
    url = task.messages[1]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.mark.parametrize("grid,size", [(3, 112), (4, 224)])
def test_each_cell_shows_the_shape_the_task_records_and_the_answers_count_them(grid, size):
    env = ShapesEnv(grid=grid, image_size=size, max_shapes=grid * 2)
    for index in range(12):
        task = env.task(index)
        image = _picture(task)
        assert image.size == (size, size)
        cell = size / grid
        drawn = {}
        for number in range(grid * grid):
            row, col = divmod(number, grid)
            # the centre of a cell is inside a circle, a square and a triangle alike
            pixel = image.getpixel((int((col + 0.5) * cell), int((row + 0.55) * cell)))
            drawn[number] = next((name for name, rgb in COLOURS.items() if rgb == pixel), None)
            if drawn[number] is None:
                assert pixel == (255, 255, 255), (index, number, pixel)
        assert {c: col for c, col in drawn.items() if col} == {
            cell: col for _, col, cell in task.info["scene"]
        }
        for question, answer in task.info["qa"]:
            if question.startswith("How many") and "shapes" in question:
                colour = question.split()[2]
                assert answer == str(sum(c == colour for c in drawn.values()))


def test_replies_are_read_as_models_write_them():
    assert parse_answer("There are 2 red shapes in the picture.", number=True) == "2"
    assert parse_answer("**Three**", number=True) == "3"
    assert parse_answer("The triangle is blue.", number=False) == "blue"
    assert parse_answer("It is red. No, Purple", number=False) == "purple"  # the last one counts
    assert parse_answer("There are 2 red shapes.", number=False) == "red"
    assert parse_answer("I cannot tell.", number=True) is None


def test_a_multi_turn_task_asks_distinct_questions_about_one_picture_and_scores_each_turn():
    env = ShapesEnv(min_turns=3, max_turns=3, min_shapes=4, max_shapes=6)
    task = env.task(0)
    questions = [q for q, _ in task.info["qa"]]
    assert len(questions) == 3 == len(set(questions))
    demo = env.demonstration(task)
    assert message_images(demo[:2]) and not message_images(demo[2:])  # later turns ask about the same picture
    episode = Episode(prompt_ids=[], messages=demo)
    assert turns_correct(task, episode) == 1.0
    wrong = [dict(m) for m in demo]
    wrong[2]["content"] = "I think " + ("7" if wrong[2]["content"] != "7" else "8")
    assert turns_correct(task, Episode(prompt_ids=[], messages=wrong)) == pytest.approx(2 / 3)
    assert turns_correct(task, Episode(prompt_ids=[], messages=demo[:3])) == pytest.approx(1 / 3)


def test_the_held_out_split_holds_out_whole_pictures():
    train = {split_key(ShapesEnv().task(i)) for i in range(60)}
    heldout = {split_key(ShapesEnv(split="heldout").task(i)) for i in range(20)}
    assert len(heldout) == 20 and not train & heldout


@pytest.mark.parametrize(
    "kwargs,problem",
    [
        ({"grid": 1}, "grid"),
        ({"max_shapes": 10}, "grid"),
        ({"image_size": 8}, "image_size"),
        ({"min_turns": 2}, "turns"),
    ],
)
def test_bad_settings_are_one_line(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        ShapesEnv(**kwargs)


def test_the_training_commands_take_pictures_only_where_the_model_trains_on_them():
    spec = EnvSpec(name="shapes")
    with pytest.raises(
        UserError, match="'shapes' gives images, but model 'tidal-testing/tiny-qwen3' has no vision tower"
    ) as caught:
        check_env(spec, "tidal-testing/tiny-qwen3")  # what `tidal rl` checks before it starts anything
    assert "\n" not in str(caught.value)
    check_env(spec, "tidal-testing/tiny-idefics3")  # a vision-language model it trains
    demos = load_conversations(BuiltinDataset(type="builtin", name="shapes", num_examples=2))  # `tidal sft`'s
    assert message_images(demos[0]) and demos[0][-1]["role"] == "assistant"
    with pytest.raises(UserError, match="gives images, but model"):
        orchestrator_env(OrchestratorConfig(env=[spec]))  # `tidal orchestrator` alone, a text model
    assert build_env(spec).gives_images  # `tidal eval` builds it (and checks the model: test_vlm)
    check_env(EnvSpec(name="alphabet_sort"), "tidal-testing/tiny-qwen3")  # a text environment passes


def _data_url(picture: Image.Image) -> str:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_pictures_are_found_in_every_content_part_form_and_a_missing_one_is_named():
    url = _data_url(Image.new("RGB", (4, 4), "blue"))
    picture = Image.new("RGB", (4, 4), "red")
    messages = [
        {"role": "system", "content": "text only"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
        },
        {
            "role": "user",
            "content": [{"type": "image", "url": "https://x/y.png"}, {"type": "image", "image": picture}],
        },
    ]
    found = message_images(messages)
    assert found[:2] == [url, "https://x/y.png"] and found[2].startswith("data:image/png;base64,")
    assert _picture_of(found[2]).getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(ValueError, match="image_url content part without a picture"):
        message_images([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


@pytest.mark.parametrize(
    "url,problem",
    [
        ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA", "cannot be read as an image"),  # a truncated PNG
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "must be data:image/"),
        ("file:///etc/passwd", "neither a data URL nor an http"),
        ("data:image/png;base64," + "A" * (22 * 2**20), "over the 16 MiB limit"),
    ],
)
def test_a_broken_or_oversized_picture_is_named_with_its_number(url, problem):
    good = {"type": "image_url", "image_url": {"url": _data_url(Image.new("RGB", (4, 4)))}}
    bad = {"type": "image_url", "image_url": {"url": url}}
    with pytest.raises(ValueError, match=f"picture 2: .*{problem}"):
        message_images([{"role": "user", "content": [good, bad]}])


def _picture_of(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class PictureSampler:
    """Answers each turn with the next scripted reply; records the prompt ids and pictures of each request."""

    def __init__(self, replies: list[str]):
        from tidal.models.tiny_vlm import build_tokenizer

        self.tokenizer, self.replies, self.requests = build_tokenizer(), list(replies), []

    async def complete(self, prompt_ids, images=()):  # type: ignore[no-untyped-def]
        from tidal.envs.base import Turn

        self.requests.append((list(prompt_ids), list(images)))
        text = self.replies.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Turn(list(prompt_ids), ids, [-0.1] * len(ids), text, "stop")


def test_a_multi_turn_episode_sends_its_picture_with_every_turn_and_continues_the_templates_ids():
    import asyncio

    from tidal.envs.base import run_episode

    env = ShapesEnv(min_turns=2, max_turns=2, min_shapes=4)
    task = env.task(0)
    sampler = PictureSampler([answer for _, answer in task.info["qa"]])
    episode = asyncio.run(run_episode(env, task, sampler))
    assert episode.reward == 1.0 and episode.num_turns == 2
    (first, first_images), (second, second_images) = sampler.requests
    assert first_images == second_images == message_images(task.messages) == episode.images
    image_id = sampler.tokenizer.convert_tokens_to_ids("<image>")
    assert first.count(image_id) == 1 and second.count(image_id) == 1  # never the expanded ids
    assert second[: len(first)] == first  # the second turn continues the first exactly


def test_a_picture_in_the_environments_reply_follows_the_episodes_in_ids_and_requests():
    import asyncio

    from tidal.envs.base import run_episode

    class PictureReply(ShapesEnv):
        async def env_response(self, task, episode):  # type: ignore[no-untyped-def]
            if episode.num_turns >= 2:
                return None
            other = (
                ShapesEnv(seed=7).task(1).messages[-1]
            )  # a user turn with another picture and its question
            return [dict(other)]

    env = PictureReply(min_turns=1, max_turns=2)
    task = env.task(0)
    sampler = PictureSampler(["1", "2"])
    episode = asyncio.run(run_episode(env, task, sampler))
    (first, first_images), (second, second_images) = sampler.requests
    added = message_images([ShapesEnv(seed=7).task(1).messages[-1]])
    assert first_images == message_images(task.messages) and len(added) == 1
    assert second_images == [*first_images, *added] == episode.images  # every turn sends them all
    image_id = sampler.tokenizer.convert_tokens_to_ids("<image>")
    assert first.count(image_id) == 1 and second.count(image_id) == 2  # one placeholder each, never expanded
    assert second[: len(first)] == first  # the episode's ids continue unchanged
    # the reply's placeholder is an environment token of the completion (mask 0), after the first reply
    placed = [
        m for t, m in zip(episode.completion_ids, episode.completion_mask, strict=True) if t == image_id
    ]
    assert placed == [0] and episode.num_turns == 2

    class Truncated(PictureReply):
        max_context_tokens = len(second) - 1  # the second prompt does not fit: its picture never enters

    cut = asyncio.run(run_episode(Truncated(min_turns=1, max_turns=2), task, PictureSampler(["1"])))
    assert cut.images == first_images and cut.info.get("truncated")


def test_new_pictures_give_each_later_turn_a_scene_of_its_own_and_keep_the_first_turn_as_before():
    import asyncio

    from tidal.envs.base import run_episode

    plain, fresh = ShapesEnv(min_turns=3, max_turns=3), ShapesEnv(min_turns=3, max_turns=3, new_pictures=True)
    for index in range(5):
        a, b = plain.task(index), fresh.task(index)
        assert b.messages == a.messages[: len(b.messages)] and b.info["qa"][0] == a.info["qa"][0]
        assert len(b.info["pictures"]) == 2 and len(set(b.info["pictures"])) == 2
        assert b.info["pictures"][0] not in message_images(b.messages)
        assert message_images(fresh.demonstration(b)) == [*message_images(b.messages), *b.info["pictures"]]
        assert "pictures" not in a.info
    task = fresh.task(0)
    answers = [answer for _, answer in task.info["qa"]]
    sampler = PictureSampler(answers)
    episode = asyncio.run(run_episode(fresh, task, sampler))
    assert episode.reward == 1.0 and episode.images == [
        *message_images(task.messages),
        *task.info["pictures"],
    ]
    assert [len(images) for _, images in sampler.requests] == [1, 2, 3]

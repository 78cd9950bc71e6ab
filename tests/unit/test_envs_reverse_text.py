"""reverse_text's reward reads the answer line of what real models write; its held-out split has 200 texts."""

import pytest

from tidal.envs.base import Episode
from tidal.envs.reverse_text import ReverseTextEnv, reversal_accuracy, reversed_text
from tidal.envs.splits import is_heldout


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("dzwa", "dzwa"),
        ("Dzwa.", "dzwa"),  # SmolLM2-135M-Instruct answered "awzd" with "Awzd."
        ("The reversed text is: dzwa", "dzwa"),
        ("```\ndzwa\n```", "dzwa"),
        ('"dzwa"', "dzwa"),
        ("**dzwa**", "dzwa"),
        ("awzd reversed is\ndzwa", "dzwa"),
        ("dz wa", "dz wa"),
        ("", ""),
    ],
)
def test_the_answer_is_the_replys_last_line_without_its_wrapping(reply, answer):
    assert reversed_text(reply) == answer


def test_only_the_right_letters_score():
    env = ReverseTextEnv(num_examples=20)
    task = env.task(0)

    def score(reply: str) -> float:
        messages = [*task.messages, {"role": "assistant", "content": reply}]
        return reversal_accuracy(task, Episode(prompt_ids=[1], messages=messages))

    assert score(f"Here it is: {task.answer}.") == 1.0
    assert score(f"{task.answer}\n\nI reversed {task.messages[1]['content']}, letter by letter.") < 0.5
    assert score(task.answer + "x" * len(task.answer)) == pytest.approx(0.5)
    assert score(task.messages[1]["content"]) < 1.0 or task.answer == task.messages[1]["content"]


def test_the_heldout_split_has_200_distinct_texts_none_trained_on():
    heldout = ReverseTextEnv(num_examples=200, split="heldout")
    texts = {heldout.task(i).messages[1]["content"] for i in range(200)}
    assert len(texts) == 200 and all(is_heldout(text) for text in texts)
    train = ReverseTextEnv(num_examples=5000)
    assert not texts & {train.task(i).messages[1]["content"] for i in range(5000)}

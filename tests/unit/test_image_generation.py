"""A generation request with pictures as the inference client sends it to vLLM's token-in route, and its
answer as the client reads it (pure: no server; tests/integration/test_vlm.py runs the real one)."""

import pytest

from tidal.inference.generation import image_generate_body, image_generation
from tidal.inference.types import GenerateRequest, SamplingParams


def test_the_request_carries_the_templates_ids_and_each_picture_as_a_content_part():
    request = GenerateRequest(
        prompt_token_ids=(1, 5, 2), images=("data:image/png;base64,AA", "https://x/y.png"), n=4,
        sampling=SamplingParams(temperature=0.7, max_tokens=9, seed=3),
    )  # fmt: skip
    body = image_generate_body(request, "tiny")
    assert body["token_ids"] == [1, 5, 2] and body["model"] == "tiny"
    assert body["content_parts"] == [
        {"type": "image_url", "url": "data:image/png;base64,AA"},
        {"type": "image_url", "url": "https://x/y.png"},
    ]
    sampling = body["sampling_params"]
    assert (sampling["n"], sampling["temperature"], sampling["max_tokens"], sampling["seed"]) == (
        4,
        0.7,
        9,
        3,
    )
    assert sampling["logprobs"] == 0 and body["output_mode"] == "text" and body["return_token_ids"] is True


def _choice(index, ids, logprobs, text):
    return {
        "index": index, "token_ids": ids, "text": text, "finish_reason": "length",
        "logprobs": {"content": [{"token": str(i), "logprob": lp} for i, lp in zip(ids, logprobs, strict=True)]},
    }  # fmt: skip


def test_the_answer_gives_the_expanded_prompt_and_each_choice_in_order():
    data = {
        "prompt_token_ids": [1, 4, 4, 4, 4, 2],
        "choices": [_choice(1, [8], [-0.5], "b"), _choice(0, [7, 9], [-0.1, -0.2], "a!")],
    }
    generation = image_generation(data, "http://s", 3)
    assert generation.prompt_token_ids == (1, 4, 4, 4, 4, 2)
    assert [c.text for c in generation.completions] == ["a!", "b"]
    assert generation.completions[0].token_ids == (7, 9) and generation.completions[0].logprobs == (
        -0.1,
        -0.2,
    )
    assert (generation.server, generation.weight_version) == ("http://s", 3)
    short = {
        "prompt_token_ids": [1],
        "choices": [{**_choice(0, [7, 9], [-0.1, -0.2], "a"), "logprobs": None}],
    }
    with pytest.raises(ValueError, match="0 logprobs for 2 tokens"):
        image_generation(short, "http://s", 3)

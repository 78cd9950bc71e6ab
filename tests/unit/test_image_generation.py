"""A generation request with pictures as the inference client sends it to tidal's picture route, its answer
as the client reads it, and the route's pure parts: the body it accepts, the pictures it decodes, the answer
it builds from vLLM's output (no server: tests/integration/test_vlm.py runs the real one)."""

import base64
import io
import json
from types import SimpleNamespace

import pytest
from PIL import Image

from tidal.inference import picture_route
from tidal.inference.generation import image_generate_body, image_generation
from tidal.inference.picture_route import PictureRequestError, answer, decode_image, parse_body
from tidal.inference.types import GenerateRequest, SamplingParams


def _png(colour: str = "red") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_clients_body_is_one_the_route_accepts_with_every_sampling_setting():
    request = GenerateRequest(
        prompt_token_ids=(1, 5, 2), images=(_png(), "https://x/y.png"), n=4,
        sampling=SamplingParams(temperature=0.7, max_tokens=9, seed=3, stop_token_ids=(2,)),
    )  # fmt: skip
    body = image_generate_body(request, "adapter-3")
    parsed = parse_body(json.dumps(body).encode())
    assert parsed.token_ids == [1, 5, 2] and parsed.images == [_png(), "https://x/y.png"]
    assert (parsed.n, parsed.model) == (4, "adapter-3")
    assert parsed.sampling == {**request.sampling.to_vllm()}
    assert (parsed.sampling["temperature"], parsed.sampling["seed"], parsed.sampling["stop_token_ids"]) == (
        0.7,
        3,
        [2],
    )


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"images": ["data:,"]}', "token_ids"),
        (b'{"token_ids": [1, -2], "images": ["data:,"]}', "token_ids"),
        (b'{"token_ids": [1], "images": []}', "images"),
        (b'{"token_ids": [1], "images": ["data:,"], "sampling": {"best_of": 2}}', "best_of"),
        (b'{"token_ids": [1], "images": ["data:,"], "n": 0}', "`n`"),
        (b'{"token_ids": [1], "images": ["data:,"], "n": true}', "`n`"),
        (b'{"token_ids": [1], "images": ["data:,"], "model": 3}', "`model`"),
    ],
)
def test_a_malformed_body_is_refused_naming_the_field(body: bytes, problem: str):
    with pytest.raises(PictureRequestError, match=problem):
        parse_body(body)


def test_pictures_decode_from_data_urls_and_fetched_urls_and_a_broken_one_is_named():
    assert decode_image(_png("blue"), 1, fetch=lambda url: b"").getpixel((0, 0)) == (0, 0, 255)
    fetched = base64.b64decode(_png("green").partition(",")[2])
    assert decode_image("https://x/p.png", 2, fetch=lambda url: fetched).getpixel((1, 1)) == (0, 128, 0)
    with pytest.raises(PictureRequestError, match="picture 3: cannot be read as an image"):
        decode_image("data:image/png;base64," + base64.b64encode(b"not a png").decode(), 3, fetch=bytes)

    def unreachable(url: str) -> bytes:
        raise OSError("connection refused")

    with pytest.raises(PictureRequestError, match="picture 4: cannot fetch .*connection refused"):
        decode_image("http://nowhere/p.png", 4, fetch=unreachable)
    with pytest.raises(PictureRequestError, match="picture 5: a data or http"):
        decode_image("file:///etc/passwd", 5, fetch=bytes)


def _output(index: int, ids: list[int], logprobs: list[float], text: str) -> SimpleNamespace:
    positions = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=-9.0)} for t, lp in zip(ids, logprobs, strict=True)]  # fmt: skip
    return SimpleNamespace(index=index, token_ids=ids, logprobs=positions, text=text, finish_reason="length")


def test_the_routes_answer_is_what_the_client_reads_the_sampled_tokens_logprob_each():
    result = SimpleNamespace(
        prompt_token_ids=[1, 4, 4, 4, 4, 2],
        outputs=[_output(1, [8], [-0.5], "b"), _output(0, [7, 9], [-0.1, -0.2], "a!")],
    )
    generation = image_generation(answer(result), "http://s", 3)
    assert generation.prompt_token_ids == (1, 4, 4, 4, 4, 2)
    assert [c.text for c in generation.completions] == ["a!", "b"]
    assert generation.completions[0].token_ids == (7, 9)
    assert generation.completions[0].logprobs == (-0.1, -0.2)
    assert (generation.server, generation.weight_version) == ("http://s", 3)
    short = SimpleNamespace(
        prompt_token_ids=[1],
        outputs=[SimpleNamespace(**{**vars(_output(0, [7, 9], [-0.1, -0.2], "a")), "logprobs": []})],
    )
    with pytest.raises(RuntimeError, match="0 logprob positions for 2 sampled tokens"):
        answer(short)
    wrong = {
        "prompt_token_ids": [1],
        "choices": [{"index": 0, "token_ids": [7, 9], "logprobs": [-0.1], "text": ""}],
    }
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        image_generation(wrong, "http://s", 3)


def test_an_adapter_is_looked_up_by_name_and_an_unknown_one_is_refused():
    lora = object()
    models = SimpleNamespace(is_base_model=lambda name: name == "base", lora_requests={"step-3": lora})
    state = SimpleNamespace(openai_serving_models=models)
    assert picture_route.lora_request(state, None) is None
    assert picture_route.lora_request(state, "base") is None
    assert picture_route.lora_request(state, "step-3") is lora
    with pytest.raises(PictureRequestError, match="no model or LoRA adapter called 'step-9'"):
        picture_route.lora_request(state, "step-9")

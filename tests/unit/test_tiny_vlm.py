"""The tiny vision-language test model (tidal.models.tiny_vlm): built locally, its processor turns a picture
of the `shapes` environment into the image tokens the model reads, and transformers runs it."""

import base64
import io

import pytest
import torch
from PIL import Image

from tidal.envs.shapes import ShapesEnv
from tidal.models.names import resolve_test_model
from tidal.models.tiny_vlm import IMAGE_SEQ_LEN, TINY_VLM_MODEL_NAME


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    pytest.MonkeyPatch().setenv("TIDAL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return resolve_test_model(TINY_VLM_MODEL_NAME)


def test_a_shapes_prompt_becomes_one_image_token_per_picture_then_the_processors_expansion(tiny_vlm):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    assert resolve_test_model(TINY_VLM_MODEL_NAME) == tiny_vlm  # built once, found again
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    task = ShapesEnv(min_shapes=3).task(0)
    # the tokenizer renders, as the rollout path does (the processor's own apply_chat_template rewrites
    # image_url parts of the messages it is given in place)
    prompt = processor.tokenizer.apply_chat_template(
        task.messages, add_generation_prompt=True, tokenize=False
    )
    assert prompt.count("<image>") == 1 and prompt.endswith("Assistant:")
    url = task.messages[1]["content"][0]["image_url"]["url"]
    picture = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    inputs = processor(text=prompt, images=[picture], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    start = tokens.index("<fake_token_around_image>")
    expected = ["<fake_token_around_image>", "<global-img>"] + ["<image>"] * IMAGE_SEQ_LEN
    assert tokens[start : start + len(expected) + 1] == [*expected, "<fake_token_around_image>"]
    assert tuple(inputs["pixel_values"].shape[-3:]) == (3, 56, 56)

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**inputs).logits
        white = processor(text=prompt, images=[Image.new("RGB", picture.size, "white")], return_tensors="pt")
        other = model(**white).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and logits.shape[2] == len(processor.tokenizer)
    assert not torch.allclose(logits[0, -1], other[0, -1])  # the picture reaches the text model

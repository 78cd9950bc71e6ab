"""Pictures in the training path, with the tiny local VLM (tidal.models.tiny_vlm): the orchestrator's expansion
of a prompt's placeholders is the processor's, packed micro-batches carry each sample's pictures in token
order, and the trainer's forward over packed rows gives every sample the logprobs transformers gives it
alone. The vision tower is frozen by default."""

import base64
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tidal.config.common import ModelConfig
from tidal.envs.base import render_prompt
from tidal.envs.chat import message_images
from tidal.envs.shapes import ShapesEnv
from tidal.errors import UserError
from tidal.models.tiny_vlm import TINY_VLM_MODEL_NAME
from tidal.models.vision import decode_picture, setup_pictures
from tidal.orchestrator.batching import build_micro_batch, make_train_samples
from tidal.testing import resolve_model_name
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.model import load_model
from tidal.types import Group, MicroBatch, PackedArray, Pictures, Rollout


@pytest.fixture(scope="module")
def pictures():
    return setup_pictures(TINY_VLM_MODEL_NAME)


def _url(colour: tuple[int, int, int], size: int = 70) -> str:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _prompt(pictures, n: int) -> tuple[list[int], list[str]]:
    content = [{"type": "image_url", "image_url": {"url": _url((40 * k, 200, 30))}} for k in range(n)]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "How many?"}]}]
    return render_prompt(pictures.processor.tokenizer, messages), message_images(messages)


def test_expansion_is_the_processors_on_the_whole_prompt(pictures):
    from transformers import AutoProcessor

    task = ShapesEnv().task(0)
    tokenizer = pictures.processor.tokenizer
    prompt, images = render_prompt(tokenizer, task.messages), message_images(task.messages)
    ids, got = pictures.expand(prompt, images)
    processor = AutoProcessor.from_pretrained(resolve_model_name(TINY_VLM_MODEL_NAME))
    whole = processor(
        text=[tokenizer.decode(prompt)],
        images=[[decode_picture(u, 1) for u in images]],
        return_tensors="np",
        add_special_tokens=False,
    )
    assert ids == whole["input_ids"][0].tolist() and len(ids) > len(prompt)
    assert got.count == 1 and got.pixel_values.shape == list(whole["pixel_values"][0].shape)
    assert (got.pixel_values.to_numpy() == whole["pixel_values"][0]).all()

    two, urls = _prompt(pictures, 2)
    ids2, got2 = pictures.expand(two, urls)
    assert got2.count == 2 and got2.pixel_values.shape[0] == 2
    with pytest.raises(ValueError, match="1 picture placeholder.*for 2 picture"):
        pictures.expand(prompt, [images[0], images[0]])
    with pytest.raises(ValueError, match="picture 1: training needs the picture itself"):
        pictures.expand(prompt, ["https://example.com/a.png"])


def test_packed_micro_batches_carry_pictures_in_token_order_through_json(pictures):
    groups = []
    for n in (1, 2):
        prompt, urls = _prompt(pictures, n)
        rollouts = [
            Rollout(prompt, [7, 8, 9], [-1.0] * 3, [1, 1, 1], float(k), 0, 0, "shapes", f"t{n}", images=urls)
            for k in range(2)
        ]
        groups.append(Group(f"t{n}", "shapes", rollouts))
    calls = []

    class Counted:
        placeholder_id = pictures.placeholder_id

        def expand(self, ids, urls):
            calls.append(len(urls))
            return pictures.expand(ids, urls)

    samples = make_train_samples(groups, expand_pictures=Counted())
    assert calls == [1, 2]  # once per distinct prompt, not per rollout
    assert [s.pictures.count for s in samples] == [1, 1, 2, 2]
    micro = build_micro_batch([samples[:1], samples[2:3]], 512, 0)
    back = MicroBatch.from_dict(json.loads(json.dumps(micro.to_dict())))
    # kept per sample, as each sample's expansion made them: packing decodes nothing
    assert back.pictures == micro.pictures and [p.count for p in back.pictures] == [1, 2]
    assert micro.pictures[0] is samples[0].pictures
    # one group's samples share their prompt's pictures: they travel once, and are decoded once
    shared = build_micro_batch([samples[:2], samples[2:]], 1024, 0)
    sent = json.loads(json.dumps(shared.to_dict()))
    assert len(sent["pictures"]) == 2 and sent["picture_order"] == [0, 0, 1, 1]
    again = MicroBatch.from_dict(sent)
    assert again.pictures[0] is again.pictures[1] and again.pictures == shared.pictures
    assert again.picture_tensors()["pixel_values"].shape[0] == 6  # 1 + 1 + 2 + 2 pictures' tiles
    # a group's samples in different micro-batches: the batch sends each picture once for all of them
    from tidal.transport.rollouts import decode, encode
    from tidal.types import TrainBatch

    split = [build_micro_batch([samples[i : i + 1]], 512, 0) for i in range(4)]
    batch = TrainBatch(step=3, micro_batches=split, num_loss_tokens_global=12, num_samples_global=4)
    wire = json.loads(encode(batch))
    assert len(wire["pictures"]) == 2 and [m["picture_order"] for m in wire["micro_batches"]] == [
        [0],
        [0],
        [1],
        [1],
    ]
    assert all(m["pictures"] is None for m in wire["micro_batches"])
    received = decode(encode(batch))
    assert [m.pictures for m in received.micro_batches] == [m.pictures for m in split]
    assert received.micro_batches[0].pictures[0] is received.micro_batches[1].pictures[0]
    image_id = pictures.placeholder_id
    in_rows = sum(row.count(image_id) for row in back.input_ids)
    per_picture = samples[0].input_ids.count(image_id)
    assert in_rows == 3 * per_picture
    tensors = back.picture_tensors()
    assert tensors["pixel_values"].shape[0] == 3 and tensors["pixel_attention_mask"].dtype == torch.bool
    with pytest.raises(ValueError, match="has pictures, but the run has no picture processor"):
        make_train_samples(groups)


def test_packed_arrays_join_only_alike():
    import numpy as np

    a = PackedArray.from_numpy(np.zeros((2, 3), dtype=np.float32))
    b = PackedArray.from_numpy(np.ones((1, 3), dtype=np.float32))
    assert PackedArray.concat([a, b]).to_numpy().tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="differ in dtype or trailing shape"):
        PackedArray.concat([a, PackedArray.from_numpy(np.ones((1, 4), dtype=np.float32))])
    with pytest.raises(ValueError, match="not float64"):
        PackedArray.from_numpy(np.ones(2))
    assert Pictures.concat([]) is None

    # the array is kept beside its text: read without decoding, carried when pickled, decoded once from JSON
    import pickle

    c = PackedArray.concat([a, b])
    assert c.to_numpy() is c.to_numpy() and not c.to_numpy().flags.writeable
    copied = pickle.loads(pickle.dumps(c))
    assert copied == c and copied._array is not None and np.array_equal(copied.to_numpy(), c.to_numpy())
    parsed = PackedArray(**json.loads(json.dumps(c.to_json())))
    assert parsed == c and parsed._array is None  # JSON holds the text alone
    assert parsed.to_numpy().tolist() == c.to_numpy().tolist() and parsed.to_numpy() is parsed.to_numpy()
    assert parsed != PackedArray.from_numpy(np.ones((3, 3), dtype=np.float32))


def test_a_text_free_copy_crosses_processes_through_shared_memory_and_makes_its_text_when_asked():
    import multiprocessing
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    values = np.arange(4 * 3 * 64 * 64, dtype=np.float32).reshape(4, 3, 64, 64)  # 192 KiB: four small tiles
    original = Pictures(1, PackedArray.from_numpy(values), PackedArray.from_numpy(values[:, 0] > 5000))
    free = original.text_free()
    assert free.pixel_values._text is None and free.pixel_values._array.is_shared()
    # what a sample worker sends: a handle to the shared tensor, not its bytes (the text: none at all)
    assert len(ForkingPickler.dumps(free)) < 4_000 < 200_000 < len(pickle.dumps(original))
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:  # a spawn worker sends one back as SamplePool's workers do
        received = pool.apply(Pictures.text_free, (original,))
    assert received == original  # compared by value: arrays where one side has no text
    assert received.pixel_values.to_numpy().tolist() == values.tolist()
    assert received.to_dict() == original.to_dict()  # the text is made from the array when asked for
    assert Pictures.from_json(json.loads(json.dumps(received.to_dict()))) == original


def test_trainer_logprobs_over_packed_rows_with_pictures_are_each_samples_alone(pictures):
    model = load_model(ModelConfig(name=TINY_VLM_MODEL_NAME))
    tower = model.model.vision_model
    assert not any(p.requires_grad for p in tower.parameters())  # frozen by default
    assert all(p.requires_grad for p in model.model.connector.parameters())
    scorer = TokenScorer(model).eval()
    samples = []
    for k, n in enumerate((1, 2, 1)):
        prompt, urls = _prompt(pictures, n)
        done = [10 + k, 11, 12 + k, 13]
        rollout = Rollout(prompt, done, [-1.0] * 4, [1] * 4, 1.0, 0, 0, "shapes", "t", images=urls)
        samples += make_train_samples([Group("t", "shapes", [rollout])], [[1.0]], expand_pictures=pictures)
    micro = build_micro_batch([samples[:2], samples[2:]], 1024, 0)  # two samples share the first row
    t = micro.to_tensors()
    with torch.no_grad():
        packed, _ = scorer(
            t["input_ids"], t["position_ids"], t["target_ids"], pictures=micro.picture_tensors()
        )
    for index, sample in enumerate(samples):
        alone = build_micro_batch([[sample]], 1024, 0)
        a = alone.to_tensors()
        inputs = {k: v.unsqueeze(0) for k, v in alone.picture_tensors().items()}
        with torch.no_grad():
            logits = model(input_ids=a["input_ids"], **inputs).logits
        want = torch.log_softmax(logits.float(), -1).gather(-1, a["target_ids"].unsqueeze(-1)).squeeze(-1)
        row = 0 if index < 2 else 1
        got = packed[row][torch.tensor(micro.sample_ids[row]) == index]
        assert len(got) == len(sample)
        assert torch.allclose(got[:-1], want[0, : len(sample) - 1], atol=1e-5), (
            (got[:-1] - want[0, :-1]).abs().max()
        )
    # the pictures reach the model: the first sample's ids with another picture score differently
    _, red = pictures.one_picture(decode_picture(_url((250, 0, 0)), 1))
    first = build_micro_batch([[samples[0]]], 1024, 0)
    repainted = MicroBatch.from_dict({**first.to_dict(), "pictures": [red.to_dict()]})
    f, r = first.to_tensors(), repainted.to_tensors()
    with torch.no_grad():
        base, _ = scorer(f["input_ids"], f["position_ids"], f["target_ids"], pictures=first.picture_tensors())
        moved, _ = scorer(
            r["input_ids"], r["position_ids"], r["target_ids"], pictures=repainted.picture_tensors()
        )
    assert (base - moved).abs().max() > 1e-4


def test_pictures_go_through_shared_memory_only_where_it_has_room(tmp_path, monkeypatch):
    import os

    import numpy as np

    from tidal.trainer import sample_pool

    tiles = Pictures(1, PackedArray.from_numpy(np.zeros((5, 3, 512, 512), dtype=np.float32)))  # 15.7 MB
    assert sample_pool.room_in_shared_memory(tiles, str(tmp_path)) == (
        os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize >= 4 * 15_728_640 + 256 * 2**20
    )
    assert not sample_pool.room_in_shared_memory(tiles, str(tmp_path / "missing"))

    class Mounted:  # a container's default /dev/shm: 64 MB
        f_bavail, f_frsize = 16_384, 4_096

    monkeypatch.setattr(os, "statvfs", lambda path: Mounted)
    assert not sample_pool.room_in_shared_memory(tiles)
    Mounted.f_bavail = 2**20  # 4 GiB
    assert sample_pool.room_in_shared_memory(tiles)


def test_a_groups_shared_picture_goes_through_the_tower_once_with_the_same_logprobs_and_gradients(pictures):
    model = load_model(ModelConfig(name=TINY_VLM_MODEL_NAME, train_vision=True))
    scorer = TokenScorer(model)
    samples = []
    for k, n in enumerate((1, 2)):  # two groups of three samples: each group's samples share one Pictures
        prompt, urls = _prompt(pictures, n)
        rollouts = [
            Rollout(
                prompt, [10 + j, 11, 12 + k], [-1.0] * 3, [1] * 3, float(j), 0, 0, "shapes", "t", images=urls
            )
            for j in range(3)
        ]
        samples += make_train_samples([Group(f"t{k}", "shapes", rollouts)], expand_pictures=pictures)
    micro = build_micro_batch([samples[:3], samples[3:]], 2048, 0)
    t = micro.to_tensors()
    once = micro.picture_tensors(once=True)
    # the first group's picture is one tile, the second's two: 3 distinct tiles, spread back to 9
    assert once["pixel_values"].shape[0] == 3
    assert once["repeat/pixel_values"].tolist() == [0, 0, 0, 1, 2, 1, 2, 1, 2]
    tiles_seen = []
    tower = model.model.vision_model
    hook = tower.register_forward_pre_hook(
        lambda m, args, kwargs: tiles_seen.append(kwargs["pixel_values"].shape[0]), with_kwargs=True
    )
    results = []
    for joined in (micro.picture_tensors(), once):
        model.zero_grad()
        logprobs, _ = scorer(t["input_ids"], t["position_ids"], t["target_ids"], pictures=joined)
        (logprobs * (t["sample_ids"] >= 0)).sum().backward()
        grad = tower.encoder.layers[0].self_attn.q_proj.weight.grad.clone()
        results.append((logprobs.detach(), grad))
    hook.remove()
    assert tiles_seen == [9, 3]  # 3 samples x 1 tile + 3 samples x 2 tiles, then 1 + 2 distinct tiles
    (every, shared), (every_grad, shared_grad) = zip(*results, strict=True)
    assert torch.allclose(every, shared, atol=1e-5) and torch.allclose(every_grad, shared_grad, atol=1e-5)
    assert every_grad.abs().sum() > 0
    assert tower.forward.__func__ is type(tower).forward  # the tower is itself again afterwards


def test_vision_tower_trains_on_request_and_a_text_model_refuses_it():
    model = load_model(ModelConfig(name=TINY_VLM_MODEL_NAME, train_vision=True))
    assert all(p.requires_grad for p in model.model.vision_model.parameters())
    with pytest.raises(
        UserError, match="model.train_vision: model 'tidal-testing/tiny-qwen3' has no vision tower"
    ):
        load_model(ModelConfig(name="tidal-testing/tiny-qwen3", train_vision=True))


def test_sft_conversations_with_pictures_expand_keep_the_mask_and_are_never_cut(pictures, tmp_path):
    from tidal.config.common import FileDataset
    from tidal.trainer.data import (
        IGNORE_INDEX,
        collate_pictures,
        pack_samples,
        pad_rows,
        tokenize_conversation,
    )
    from tidal.trainer.sources import load_conversations

    Image.new("RGB", (60, 60), (250, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    rows = [
        {"messages": [
            {"role": "user", "content": [{"type": "image", "path": "red.png"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "red"},
        ]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello"}]},
    ]  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    conversations = load_conversations(FileDataset(path=data))
    assert conversations[0][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")

    tokenizer = pictures.processor.tokenizer
    text = tokenize_conversation(tokenizer, conversations[0])
    ids, mask, got = pictures.expand_masked(text.input_ids, text.loss_mask, message_images(conversations[0]))
    grown = len(ids) - len(text.input_ids)
    assert grown > 0 and got.count == 1 and len(mask) == len(ids)
    learnt = [t for t, m in zip(ids, mask, strict=True) if m]
    assert learnt == [t for t, m in zip(text.input_ids, text.loss_mask, strict=True) if m]
    assert tokenizer.decode(learnt) == " red<|im_end|>"

    from tidal.trainer.data import TokenizedSample

    with_picture = TokenizedSample(ids, mask, got)
    plain = tokenize_conversation(tokenizer, conversations[1])
    packed, cut = pack_samples([with_picture, plain, with_picture], len(ids) + len(plain.input_ids))
    assert cut == 0 and len(packed) == 2 and [len(r.pictures) for r in packed] == [1, 1]
    joined = collate_pictures(pad_rows(packed, 1024, 0))
    assert joined["pixel_values"].shape[0] == 2 * got.pixel_values.shape[0]
    assert torch.equal(joined["pixel_values"][: got.pixel_values.shape[0]], got.tensors()["pixel_values"])
    assert sum(label != IGNORE_INDEX for label in packed[0].labels) == sum(mask) + sum(plain.loss_mask)
    short, cut = pack_samples([with_picture, plain], len(ids) - 1)  # too long: left out, not cut
    assert cut == 1 and [len(r.pictures) for r in short] == [0] and len(short[0]) == len(plain.input_ids)

    for bad, problem in (
        ("broken.png", "picture 1: cannot be read as an image"),
        ("gone.png", "cannot read"),
    ):
        rows[0]["messages"][0]["content"][0] = {"type": "image", "path": bad}
        data.write_text(json.dumps(rows[0]) + "\n")
        with pytest.raises(UserError, match=f"train.jsonl:1: .*{problem}") as caught:
            load_conversations(FileDataset(path=data))
        assert "\n" not in str(caught.value)
    rows[0]["messages"][0]["content"] = [{"type": "audio"}]
    data.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(UserError, match=r"messages\[0\].content part 0: a content part is text or a picture"):
        load_conversations(FileDataset(path=data))


def test_sft_picture_setup_and_lora_on_a_vlm_adapts_the_language_model_only():
    from tidal.config.lora import LoraConfig
    from tidal.config.sft import SFTConfig
    from tidal.trainer.lora import apply_lora
    from tidal.trainer.sft import setup_sft_pictures

    picture = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url((9, 9, 9))}}]}]
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [*picture, {"role": "assistant", "content": "black"}],
    ]
    base = {"model": {"name": TINY_VLM_MODEL_NAME}, "data": {"train": {"type": "builtin", "name": "shapes"}}}
    assert setup_sft_pictures(SFTConfig(**base), conversations) is not None
    assert setup_sft_pictures(SFTConfig(**base, lora={"rank": 8}), conversations) is not None
    with pytest.raises(UserError, match="conversation 1 has pictures, but model 'tidal-testing/tiny-qwen3'"):
        setup_sft_pictures(
            SFTConfig(**{**base, "model": {"name": "tidal-testing/tiny-qwen3"}}), conversations
        )
    assert setup_sft_pictures(SFTConfig(**base), conversations[:1]) is None  # text data: no processor

    # the tower's attention has q_proj/k_proj/v_proj too: the adapters go on the language model's alone
    model = load_model(ModelConfig(name=TINY_VLM_MODEL_NAME))
    tower = [
        n for n, _ in model.named_modules() if n.startswith("model.vision_model.") and n.endswith("q_proj")
    ]
    adapted = apply_lora(model, LoraConfig(rank=4))
    assert tower and adapted and all(n.startswith("model.text_model.") for n in adapted)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "vision_model" in n)


def test_a_reply_holding_a_picture_token_is_refused(pictures):
    from tidal.models.vision import check_reply, picture_token_ids

    ids = picture_token_ids(pictures.processor.tokenizer)
    assert ids == {pictures.placeholder_id}
    check_reply([10, 11, 12], ids)
    with pytest.raises(ValueError, match=f"picture token id {pictures.placeholder_id}, which only a picture"):
        check_reply([10, pictures.placeholder_id], ids)
    from transformers import AutoTokenizer

    assert (
        picture_token_ids(AutoTokenizer.from_pretrained(resolve_model_name("tidal-testing/tiny-qwen3")))
        == set()
    )


def test_a_picture_an_environment_turn_added_is_expanded_in_place_and_reaches_the_model(pictures):
    from tidal.envs.chat import continue_prompt
    from tidal.inference.types import ChatMessage

    tokenizer = pictures.processor.tokenizer
    prompt, urls = _prompt(pictures, 1)
    first_reply = tokenizer("red", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    added = _url((10, 10, 240))
    history = [ChatMessage(role="user", content="How many?"), ChatMessage(role="assistant", content="red")]
    new = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}]
    context = continue_prompt(tokenizer, prompt + first_reply, history, new)
    env_tokens = context[len(prompt) + len(first_reply) :]
    assert env_tokens.count(pictures.placeholder_id) == 1  # one placeholder, as vLLM gets it
    second_reply = tokenizer("blue", add_special_tokens=False)["input_ids"]
    completion = first_reply + env_tokens + second_reply
    mask = [1] * len(first_reply) + [0] * len(env_tokens) + [1] * len(second_reply)
    logprobs = [-0.5 - i / 100 for i in range(len(completion))]
    logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
    rollout = Rollout(prompt, completion, logprobs, mask, 1.0, 0, 0, "shapes", "t", images=[*urls, added])
    (sample,) = make_train_samples([Group("t", "shapes", [rollout])], [[1.0]], expand_pictures=pictures)
    whole, both = pictures.expand(prompt + completion, [*urls, added])  # the processor on the whole episode
    assert sample.input_ids == whole and sample.pictures is not None and sample.pictures.count == 2
    assert (sample.pictures.pixel_values.to_numpy() == both.pixel_values.to_numpy()).all()
    # the model's tokens keep their mask and logprobs; the picture's tokens are the environment's (0, 0.0)
    trained = [
        (t, lp)
        for t, m, lp in zip(sample.input_ids, sample.loss_mask, sample.inference_logprobs, strict=True)
        if m
    ]
    assert trained == [(t, lp) for t, m, lp in zip(completion, mask, logprobs, strict=True) if m]
    assert sample.input_ids.index(pictures.placeholder_id) < len(prompt) + len(
        first_reply
    )  # the first in place
    with pytest.raises(ValueError, match="1 pictures for 2 picture placeholders"):
        make_train_samples(
            [Group("t", "shapes", [dataclasses.replace(rollout, images=urls)])],
            [[1.0]],
            expand_pictures=pictures,
        )
    model = load_model(ModelConfig(name=TINY_VLM_MODEL_NAME))
    scorer = TokenScorer(model).eval()
    micro = build_micro_batch([[sample]], 1024, 0)
    t = micro.to_tensors()
    with torch.no_grad():
        got, _ = scorer(t["input_ids"], t["position_ids"], t["target_ids"], pictures=micro.picture_tensors())
        inputs = {k: v.unsqueeze(0) for k, v in micro.picture_tensors().items()}
        logits = model(input_ids=t["input_ids"], **inputs).logits
    want = torch.log_softmax(logits.float(), -1).gather(-1, t["target_ids"].unsqueeze(-1)).squeeze(-1)
    n = len(sample) - 1
    assert torch.allclose(got[0, :n], want[0, :n], atol=1e-5)


def test_sft_held_out_eval_on_picture_conversations_answers_as_transformers_with_the_processor():
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from tidal.models.tiny_vlm import TINY_QWEN_VL_MODEL_NAME
    from tidal.trainer.evaluate import greedy_exact_match

    env = ShapesEnv(min_turns=2, max_turns=2)
    conversations = [env.demonstration(env.task(i)) for i in range(3)]
    path = resolve_model_name(TINY_VLM_MODEL_NAME)
    result = greedy_exact_match(Path(path), conversations, 6, 2, torch.device("cpu"))
    assert result.num_examples == 3 and 0.0 <= result.exact_match <= 1.0
    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for conversation, (_, reference, answer) in zip(conversations, result.examples, strict=True):
        last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        prompt = conversation[:last]
        text = processor.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        images = [decode_picture(u, 1) for u in message_images(prompt)]
        inputs = processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        assert answer == processor.tokenizer.decode(out, skip_special_tokens=True)
        assert reference == conversation[last]["content"]
    qwen = greedy_exact_match(
        Path(resolve_model_name(TINY_QWEN_VL_MODEL_NAME)), conversations[:1], 4, 1, "cpu"
    )
    assert qwen.num_examples == 1 and len(qwen.examples) == 1  # multimodal positions: runs through generate


def test_sft_picture_workers_prepare_the_same_batches_a_step_ahead_and_resume_where_trained(pictures):
    """With a worker process, each step's samples are the ones prepared in the training process (ids, mask,
    pixels), the state counts only the batches handed out (the workers run a step ahead), a run resumed
    from it gets the next batch, and a broken picture names its conversation."""
    from tidal.config.sft import SFTConfig
    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.sample_pool import SamplePool, auto_workers
    from tidal.trainer.sft import SFTData, setup_sample_pool

    def conversation(k: int) -> list[dict]:
        content = [{"type": "image_url", "image_url": {"url": _url((30 * k, 90, 200 - 20 * k), 40 + 6 * k)}}]
        return [
            {"role": "user", "content": [*content, {"type": "text", "text": f"Colour {k}?"}]},
            {"role": "assistant", "content": f"colour {k}"},
        ]

    conversations = [conversation(k) for k in range(6)] + [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello"}]
    ]
    config = SFTConfig(
        model={"name": TINY_VLM_MODEL_NAME},
        data={"train": {"type": "builtin", "name": "shapes"}, "batch_size": 3, "seq_len": 4096, "micro_batch_size": 4},
    )  # fmt: skip
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    tokenizer = pictures.processor.tokenizer

    def batches(data: SFTData, n: int) -> list[tuple[list, list]]:
        out = []
        for _ in range(n):
            rows = [r for m in data.next_batch().micro_batches for r in m]
            out.append(
                ([r.input_ids for r in rows], [p.tensors()["pixel_values"] for r in rows for p in r.pictures])
            )
        return out

    here = SFTData(config, conversations, tokenizer, info, pictures)
    expected = batches(here, 3)
    pool = SamplePool(1, tokenizer, pictures)
    ahead = SFTData(config, conversations, tokenizer, info, pictures, pool)
    try:
        got = batches(ahead, 2)
        assert (
            ahead.state_dict() == {"position": 6} and ahead.sampler.position == 9
        )  # one step prepared ahead
        assert [ids for ids, _ in got] == [ids for ids, _ in expected[:2]]
        for (_, mine), (_, theirs) in zip(got, expected[:2], strict=True):
            assert len(mine) == len(theirs) and all(
                torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)
            )
        resumed = SFTData(config, conversations, tokenizer, info, pictures, pool)
        resumed.load_state_dict(ahead.state_dict())
        assert [ids for ids, _ in batches(resumed, 1)] == [expected[2][0]]

        broken = [*conversations]
        broken[1] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, {"role": "assistant", "content": "x"}]  # fmt: skip
        bad = SFTData(config.model_copy(update={"data": config.data.model_copy(update={"shuffle": False})}), broken, tokenizer, info, pictures, pool)  # fmt: skip
        with pytest.raises(
            UserError, match=r"^data.train: conversation 1: picture 1: cannot be read as an image"
        ):
            bad.next_batch()
    finally:
        pool.close()

    assert auto_workers(1, cpus=2) == 1 and auto_workers(8, cpus=16) == 1 and auto_workers(1, cpus=64) == 8
    assert setup_sample_pool(config.model_copy(update={"data": config.data.model_copy(update={"picture_workers": 0})}), info, tokenizer, pictures) is None  # fmt: skip
    with pytest.raises(UserError, match=r"^data.picture_workers = 2: data.train has no pictures"):
        setup_sample_pool(config.model_copy(update={"data": config.data.model_copy(update={"picture_workers": 2})}), info, tokenizer, None)  # fmt: skip


def test_a_sample_pool_starts_its_workers_when_made_not_at_its_first_submit():
    """`tidal sft` makes its pool before loading the model: the workers must start then, to overlap it."""
    import time

    from tidal.trainer.sample_pool import SamplePool

    pool = SamplePool(2, None, None)
    try:
        deadline = time.monotonic() + 60
        while len(pool.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.pids()) == 2  # nothing submitted yet
    finally:
        pool.close()


def test_sft_picture_workers_die_when_the_training_process_is_sigkilled():
    import textwrap

    from tests.unit.test_reward_pool import assert_workers_die_with_parent

    script = textwrap.dedent(
        """
        import time
        from tidal.trainer.sample_pool import SamplePool

        pool = SamplePool(2, None, None)
        # two at once start both workers (no tokenizer: each call fails in its worker, which stays up)
        calls = [pool.submit([{"role": "user", "content": "Hi"}], []) for _ in range(2)]
        [call.exception() for call in calls]
        print(*pool.pids(), flush=True)
        time.sleep(60)
        """
    )
    assert_workers_die_with_parent(script, 2)

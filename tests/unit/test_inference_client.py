"""Client routing, retries and typed errors against real local HTTP servers answered by test functions (no vLLM)."""

import asyncio
import json
from collections import Counter

import httpx
import pytest
from aiohttp import web

from tests.unit.http_servers import Seen, client_over, reply
from tidal.inference.client import InferenceClient
from tidal.inference.errors import NoHealthyServer, RequestRejected, ServerFailed
from tidal.inference.fanout import parse_version
from tidal.inference.pool import ServerPool
from tidal.inference.types import GenerateRequest, Generation, SamplingParams

WORKERS = pytest.mark.parametrize("http_workers", [0, 2], ids=["on-loop", "http-workers"])
"""Client behaviour that must not change when generation requests go through HTTP worker processes."""

REQUEST = GenerateRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2, temperature=1.0))


def completion(seen: Seen | None = None) -> web.Response:
    choice = {
        "index": 0,
        "text": "xy",
        "token_ids": [7, 8],
        "prompt_token_ids": [1, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.5]},
        "finish_reason": "length",
    }
    return reply(200, {"choices": [choice]})


async def generate_many(client: InferenceClient, count: int) -> list[Generation]:
    return list(await asyncio.gather(*(client.generation.generate(REQUEST) for _ in range(count))))


@WORKERS
def test_generation_is_parsed_into_typed_tokens_and_logprobs(http_workers: int) -> None:
    seen: list[bytes] = []

    def handler(request: Seen) -> web.Response:
        seen.append(request.body)
        return completion(request)

    async def go() -> None:
        async with client_over(handler, ("a",), http_workers=http_workers) as (client, urls):
            generation = await client.generation.generate(REQUEST)
        assert generation.completions[0].token_ids == (7, 8) and generation.completions[0].logprobs == (
            -0.5,
            -1.5,
        )
        assert generation.prompt_token_ids == (1, 2) and generation.server == urls["a"]
        assert generation.weight_version == 0

    asyncio.run(go())
    body = seen[0].decode()
    assert '"top_k":-1' in body.replace(" ", "") and '"top_p":1.0' in body.replace(" ", "")


def test_least_loaded_with_ties_to_the_least_recently_used_and_sticky_sessions() -> None:
    A, B = "http://a:1", "http://b:1"  # picking sends nothing
    pool = ServerPool([A, B])
    assert [pool.pick().url for _ in range(4)] == [A, B, A, B]
    pool.servers[A].in_flight = 3
    assert pool.pick().url == B and pool.pick().url == B
    pool.servers[A].in_flight = 0
    first = pool.pick("s").url
    assert all(pool.pick("s").url == first for _ in range(5))
    pool.servers[first].healthy = False
    assert pool.pick("s").url != first  # the session moves when its server is out


@WORKERS
def test_connection_failure_moves_the_request_and_takes_the_server_out(http_workers: int) -> None:
    async def go() -> None:
        async with client_over(completion, ("b",), refused=("a",), http_workers=http_workers) as (
            client,
            urls,
        ):
            results = await generate_many(client, 4)
            assert Counter(g.server for g in results) == {urls["b"]: 4}
            assert not client.pool.servers[urls["a"]].healthy

    asyncio.run(go())


@WORKERS
def test_transient_status_is_retried_and_client_errors_are_not(http_workers: int) -> None:
    calls: Counter[str] = Counter()

    def flaky(request: Seen) -> web.Response:
        calls["n"] += 1
        return reply(503) if calls["n"] < 3 else completion(request)

    def rejecting(request: Seen) -> web.Response:
        calls["bad"] += 1
        return reply(400, {"error": {"message": "Token id 99 is out of vocabulary"}})

    async def go() -> None:
        async with client_over(flaky, ("a",), http_workers=http_workers) as (client, _):
            assert (await client.generation.generate(REQUEST)).completions[0].token_ids == (7, 8)
        async with client_over(rejecting, ("a",), http_workers=http_workers) as (client, _):
            with pytest.raises(RequestRejected, match="out of vocabulary") as info:
                await client.generation.generate(REQUEST)
        assert info.value.status == 400 and calls["bad"] == 1

    asyncio.run(go())


@WORKERS
def test_retries_are_bounded_and_end_in_typed_errors(http_workers: int) -> None:
    async def go() -> None:
        async with client_over(lambda r: reply(502), ("a",), http_workers=http_workers) as (client, _):
            with pytest.raises(ServerFailed, match="4 times"):
                await client.generation.generate(REQUEST)
        async with client_over(  # a healthy server's 500 is the request's: not retried elsewhere
            lambda r: reply(200 if r.path == "/health" else 500, {"error": "boom"}),
            ("a",),
            http_workers=http_workers,
        ) as (client, _):
            with pytest.raises(ServerFailed, match="500"):
                await client.generation.generate(REQUEST)
        async with client_over(completion, (), refused=("a", "b"), http_workers=http_workers) as (client, _):
            with pytest.raises(NoHealthyServer):
                await client.generation.generate(REQUEST)

    asyncio.run(go())


def test_version_strings_from_vllm() -> None:
    assert parse_version("default") == 0 and parse_version("12") == 12 and parse_version(None) == 0


def test_weight_fan_out_calls_vllm_rl_routes_in_order_and_tracks_versions_without_weight_info() -> None:
    calls: list[str] = []

    def vllm_026(request: Seen) -> web.Response:  # no /weight_info before vLLM 0.3x
        calls.append(f"{request.server}{request.path}")
        return reply(404 if request.path == "/weight_info" else 200, {})

    async def go() -> None:
        async with client_over(vllm_026, load_route_served=False) as (client, urls):
            report = await client.weights.load_step("/run/weights/step_3", 3)
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
            assert await client.weights.versions() == {urls["a"]: 3, urls["b"]: 3}
            # a server without the route is not asked again: one round trip less per update
            calls.clear()
            assert (await client.weights.load_step("/run/weights/step_4", 4)).all_ok
            assert [c[1:] for c in calls if c.startswith("a")][-1] == "/resume"
            assert not any(c.endswith("/weight_info") for c in calls)
            assert client.weights.phase_seconds == {}  # no server ran the update in one request

    asyncio.run(go())


def test_a_server_with_tidals_route_runs_the_whole_update_in_one_request() -> None:
    """The orchestrator's loop is busy with streaming requests: five sequential round trips per update cost
    it ~0.25 s on an H100 for a 20 ms load. tidal's guard runs the five calls in the server instead."""
    outer: list[str] = []
    inner: list[tuple[str, str, bytes]] = []

    def vllm(request: Seen) -> web.Response:
        inner.append((request.server, request.path, request.body))
        return reply(404 if request.path == "/weight_info" else 200, {})

    async def go() -> None:
        async with client_over(vllm) as (client, urls):
            original = client.pool.request

            async def counted(method: str, url: str, *args: object, **kwargs: object) -> object:
                outer.append(url)
                return await original(method, url, *args, **kwargs)  # type: ignore[arg-type]

            client.pool.request = counted  # type: ignore[method-assign]
            for version in (3, 4):
                report = await client.weights.load_step(f"/run/weights/step_{version}", version)
                assert report.all_ok and [s.version for s in report.servers] == [version, version]
            a_urls = [u[len(urls["a"]) :] for u in outer if u.startswith(urls["a"])]
            assert a_urls == ["/tidal/load_weights", "/weight_info", "/tidal/load_weights"]
        a_paths = [path for server, path, _ in inner if server == "a" and path != "/weight_info"]
        assert a_paths == 2 * [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        finishes = [b for server, path, b in inner if server == "a" and path == "/finish_weight_update"]
        assert [json.loads(body)["weight_version"] for body in finishes] == ["3", "4"]
        phases = client.weights.phase_seconds
        assert set(phases) == {"pause", "start", "update", "finish", "resume"} and min(phases.values()) >= 0

    asyncio.run(go())


def test_the_one_request_update_resumes_and_closes_the_session_when_the_load_fails() -> None:
    inner: list[str] = []

    def refusing(request: Seen) -> web.Response:
        inner.append(request.path)
        if request.path == "/update_weights":
            return reply(400, {"error": {"message": "no *.safetensors files in /x"}})
        return reply(200, {})

    async def go() -> None:
        async with client_over(refusing, ("a",)) as (client, _):
            report = await client.weights.load_step("/x", 1)
        assert not report.all_ok and report.servers[0].error is not None
        assert "update: no *.safetensors files in /x" in report.servers[0].error
        assert inner == [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]

    asyncio.run(go())


def test_failed_load_closes_the_update_and_resumes() -> None:
    calls: list[str] = []

    def refusing(request: Seen) -> web.Response:
        calls.append(request.path)
        if request.path == "/update_weights":
            return reply(400, {"error": {"message": "no *.safetensors files in /x"}})
        return reply(200, {"weight_version": "0"})

    async def go() -> None:
        async with client_over(refusing, ("a",)) as (client, _):
            report = await client.weights.load_step("/x", 1)
        assert not report.all_ok and "safetensors" in (report.servers[0].error or "")
        assert calls == [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]

    asyncio.run(go())


class UpdateSessions:
    """A server that keeps vLLM's weight-update session and pause state: a second start while a session is
    open, or a finish without one, is refused (vLLM 0.32 raises in the worker)."""

    def __init__(self, active: bool, paused: bool):
        self.active, self.paused, self.version = active, paused, 0

    def __call__(self, request: Seen) -> web.Response:
        if request.path == "/start_weight_update":
            if self.active:
                return reply(
                    500, {"error": "start_weight_update called while a weight update is already active"}
                )
            self.active = True
        elif request.path == "/finish_weight_update":
            if not self.active:
                return reply(500, {"error": "finish_weight_update called without a matching start"})
            self.active = False
            self.version = int(request.json().get("weight_version") or self.version)
        elif request.path in ("/pause", "/resume"):
            self.paused = request.path == "/pause"
        return reply(200, {"weight_version": str(self.version)})


@pytest.mark.parametrize("active", [True, False], ids=["session-left-open", "no-session"])
def test_a_session_and_a_pause_left_by_a_dead_client_do_not_stop_the_next_update(active: bool) -> None:
    """An orchestrator killed between start_weight_update and finish (or before resume) leaves the server
    so; the restarted one resumes it (`reclaim`: its version may already be the latest, so no update need
    follow) and its next update closes the open session first, or every update would be refused."""
    left = UpdateSessions(active=active, paused=True)

    async def go() -> None:
        async with client_over(left, ("a",)) as (client, _):
            await client.weights.reclaim()
            assert not left.paused
            report = await client.weights.load_step("/w/step_3", 3)
            assert report.all_ok and left.version == 3 and not left.active and not left.paused

    asyncio.run(go())


@WORKERS
def test_a_500_from_a_server_that_then_fails_its_health_check_moves_the_request(http_workers: int) -> None:
    """A dying vLLM engine answers what it held with 500 ("EngineCore encountered an issue") before /health
    fails: that server leaves rotation and the request goes to another one, rather than failing the run."""
    dying = {"a": False}

    def handler(request: Seen) -> web.Response:
        if request.server == "a":
            if request.path == "/health":
                return reply(503 if dying["a"] else 200)
            dying["a"] = True
            return reply(500, {"error": "EngineCore encountered an issue. See stack trace (above)"})
        return completion(request)

    async def go() -> None:
        async with client_over(handler, ("a", "b"), http_workers=http_workers) as (client, urls):
            results = await generate_many(client, 4)
            assert Counter(g.server for g in results) == {urls["b"]: 4}
            assert dying["a"] and not client.pool.servers[urls["a"]].healthy

    asyncio.run(go())


def test_admin_calls_carry_the_token_and_generation_calls_do_not() -> None:
    seen: list[tuple[str, str | None]] = []

    def record(request: Seen) -> web.Response:
        seen.append((request.path, request.headers.get("X-Admin-Token")))
        return (
            completion(request) if request.path == "/v1/completions" else reply(200, {"weight_version": "2"})
        )

    async def go() -> None:
        async with client_over(record, ("a",), admin_token="t") as (client, _):
            await client.generation.generate(REQUEST)
            assert (await client.weights.load_step("/w", 2)).all_ok

    asyncio.run(go())
    tokens = dict(seen)
    assert tokens["/v1/completions"] is None and tokens["/pause"] == "t" and tokens["/update_weights"] == "t"


def test_trainer_side_sync_client_speaks_vllm_rl_routes_with_the_token() -> None:
    from tidal.transport.nccl import AdminWeightSyncClient

    seen: list[tuple[str, str | None, bytes]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("x-admin-token"), request.read()))
        return httpx.Response(200, json={})

    # The trainer side stays a synchronous httpx client (a handful of calls per update).
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


@WORKERS
def test_a_timeout_is_retried_elsewhere_without_taking_the_server_out(http_workers: int) -> None:
    async def slow_a(request: Seen) -> web.Response:
        if request.server == "a":
            await asyncio.sleep(5)  # past the client's timeout; the client hangs up first
        return completion(request)

    async def go() -> None:
        async with client_over(slow_a, timeout=0.3, http_workers=http_workers) as (client, urls):
            assert (await client.generation.generate(REQUEST)).server == urls[
                "b"
            ]  # least recently used A went first
            assert client.pool.servers[
                urls["a"]
            ].healthy  # slow is not dead: only the health watch decides that

    asyncio.run(go())


def test_a_server_still_starting_is_not_reported_lost_and_one_that_was_up_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`tidal rl` starts the orchestrator while vLLM loads: a server that never answered is loading, and its
    first answer is "up", not "back"; one that answered and then stopped is taken out of rotation by the
    health watch, and brought back once it answers again."""
    up = {"a": False}

    def health(request: Seen) -> web.Response:
        if request.path == "/health":
            return reply(200 if up[request.server] else 503)
        return reply(200, {"weight_version": "0"})

    async def go() -> None:
        async with client_over(health, ("a",)) as (client, urls):
            url = urls["a"]
            assert await client.pool.check_health() == {url: False}
            up["a"] = True
            assert await client.pool.check_health() == {url: True}
            starting = [r.getMessage() for r in caplog.records]
            assert starting == [f"inference server {url} up (version 0)"], starting
            up["a"] = False
            assert await client.pool.check_health() == {url: False}
            up["a"] = True
            assert await client.pool.check_health() == {url: True}
            lost = [r.getMessage() for r in caplog.records][1:]
            assert lost == [
                f"inference server {url} out of rotation: health check failed",
                f"inference server {url} back in rotation (version 0)",
            ], lost

    with caplog.at_level("INFO", logger="tidal.inference.pool"):
        asyncio.run(go())


def test_the_watch_probes_only_servers_that_answered_nothing_lately() -> None:
    probed: Counter[str] = Counter()

    def handler(request: Seen) -> web.Response:
        if request.path == "/health":
            probed[request.server] += 1
            return reply(200)
        return (
            completion(request) if request.path == "/v1/completions" else reply(200, {"weight_version": "0"})
        )

    async def go() -> None:
        async with client_over(handler, health_interval=30.0) as (client, urls):
            client.pool.pick()  # the next request goes to b
            assert (await client.generation.generate(REQUEST)).server == urls["b"]
            await client.pool._watch_round()
            assert probed == {"a": 1}  # b just answered: it is up
            client.pool.mark_down(client.pool.servers[urls["b"]], "test")
            await client.pool._watch_round()
            assert (
                probed == {"a": 2, "b": 1} and client.pool.servers[urls["b"]].healthy
            )  # down ones are asked

    asyncio.run(go())


@WORKERS
def test_while_one_replica_loads_weights_requests_go_to_the_other_and_record_the_version_that_answers(
    http_workers: int,
) -> None:
    """A pinned session waits for its replica's update and is recorded with the new version; the others go
    to the replica that is not loading (before: they queued behind the load, recorded with the old one)."""
    release = asyncio.Event()

    async def handler(request: Seen) -> web.Response:
        if request.path == "/update_weights" and request.server == "a":
            await release.wait()  # replica A is slow to load
        if request.path == "/v1/completions":
            return completion(request)
        return reply(404 if request.path == "/weight_info" else 200, {})

    async def go() -> None:
        async with client_over(handler, http_workers=http_workers) as (client, urls):
            a, b = urls["a"], urls["b"]
            assert client.pool.pick("episode").url == a  # the episode's earlier turns were on A
            update = asyncio.create_task(
                client.weights._load_one(client.pool.servers[a], "/run/weights/step_1", 1)
            )
            while not client.pool.servers[a].updating:
                await asyncio.sleep(0.01)
            during = await generate_many(client, 4)
            pinned = asyncio.create_task(client.generation.generate(REQUEST, session_id="episode"))
            await asyncio.sleep(0.05)
            assert not pinned.done()  # held for A's new weights rather than sent into its paused queue
            release.set()
            assert (await update).ok
            assert [(g.server, g.weight_version) for g in during] == [(b, 0)] * 4
            answer = await pinned
            assert (answer.server, answer.weight_version) == (a, 1)

    asyncio.run(go())

"""Real local HTTP servers for client tests: named servers on free ports, each request answered by a Python
function, and URLs where nothing listens (connection refused)."""

import contextlib
import dataclasses
import inspect
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from tidal.config.rl import ClientConfig
from tidal.inference import load_route
from tidal.inference.client import InferenceClient
from tidal.inference.pool import PoolTuning


@dataclass(frozen=True)
class Seen:
    """One request as the server received it; `server` is the name the test gave that server."""

    server: str
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


Handler = Callable[[Seen], web.StreamResponse | Awaitable[web.StreamResponse]]


def reply(status: int = 200, body: Any = None) -> web.Response:
    """An answer with a JSON body (none when `body` is None)."""
    if body is None:
        return web.Response(status=status)
    return web.json_response(body, status=status)


def refused_url() -> str:
    """A local URL that refuses connections: a port that was free a moment ago, with no listener now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def _answer(handler: Handler, seen: Seen) -> web.StreamResponse:
    result = handler(seen)
    return await result if inspect.isawaitable(result) else result


async def _load_route(handler: Handler, seen: Seen) -> web.StreamResponse:
    """tidal's one-request weight update as its guard serves it (`load_route.load_weights`): each of the five
    calls goes to `handler` as its own request, with the same server name and headers."""
    parsed = load_route.parse_body(seen.body)
    if isinstance(parsed, str):
        return reply(400, {"error": {"message": parsed}})

    async def call(path: str, query: str, body: bytes) -> tuple[int, bytes]:
        answer = await _answer(handler, Seen(seen.server, "POST", path, seen.headers, body))
        return answer.status, getattr(answer, "body", b"") or b""

    update, version, mode = parsed
    try:
        seconds = await load_route.load_weights(call, update, version, mode)
    except load_route.PhaseFailed as exc:
        return reply(exc.status, {"error": {"message": str(exc)}})
    return reply(200, {"weight_version": version, "seconds": seconds})


@asynccontextmanager
async def serving(
    handler: Handler, names: Sequence[str] = ("a", "b"), load_route_served: bool = True
) -> AsyncIterator[dict[str, str]]:
    """Start one server per name, all answered by `handler`; yields name -> base URL; stops them after.

    `load_route_served`: `load_route.ROUTE` is answered as tidal's guard does, through `handler`; without it
    the route is a 404, as on a vLLM started without the guard."""
    started: list[TestServer] = []

    def route(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def answer(request: web.Request) -> web.StreamResponse:
            seen = Seen(name, request.method, request.path, request.headers, await request.read())
            if seen.path == load_route.ROUTE:
                return await _load_route(handler, seen) if load_route_served else reply(404)
            return await _answer(handler, seen)

        return answer

    try:
        urls = {}
        for name in names:
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", route(name))
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            started.append(server)
            urls[name] = str(server.make_url("")).rstrip("/")
        yield urls
    finally:
        for server in started:
            await server.close()


def make_client(
    urls: Sequence[str], *, model: str | None = None, require_routes: bool = False, **options: Any
) -> InferenceClient:
    """`InferenceClient.from_config` over `urls`; `options` are `ClientConfig` fields or `PoolTuning`'s."""
    tuning_fields = {f.name for f in dataclasses.fields(PoolTuning)}
    tuning = PoolTuning(**{k: v for k, v in options.items() if k in tuning_fields})
    config = ClientConfig(urls=list(urls), **{k: v for k, v in options.items() if k not in tuning_fields})
    return InferenceClient.from_config(config, model=model, require_routes=require_routes, tuning=tuning)


@asynccontextmanager
async def client_over(
    handler: Handler,
    names: Sequence[str] = ("a", "b"),
    refused: Sequence[str] = (),
    load_route_served: bool = True,
    **kwargs: Any,
) -> AsyncIterator[tuple[InferenceClient, dict[str, str]]]:
    """An InferenceClient (no retry backoff, model "m" unless given) over servers `names` answered by
    `handler` (`serving`), after URLs named `refused` that nobody serves; yields it with name -> URL, closes
    both after."""
    async with serving(handler, names, load_route_served) as served:
        urls = {**{name: refused_url() for name in refused}, **served}
        options = {"model": "m", "backoff": 0.0, **kwargs}
        async with contextlib.aclosing(make_client(list(urls.values()), **options)) as client:
            yield client, urls

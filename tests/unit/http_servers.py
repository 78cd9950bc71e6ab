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


@asynccontextmanager
async def serving(handler: Handler, names: Sequence[str] = ("a", "b")) -> AsyncIterator[dict[str, str]]:
    """Start one server per name, all answered by `handler`; yields name -> base URL; stops them after."""
    started: list[TestServer] = []

    def route(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def answer(request: web.Request) -> web.StreamResponse:
            seen = Seen(name, request.method, request.path, request.headers, await request.read())
            result = handler(seen)
            return await result if inspect.isawaitable(result) else result

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
    handler: Handler, names: Sequence[str] = ("a", "b"), refused: Sequence[str] = (), **kwargs: Any
) -> AsyncIterator[tuple[InferenceClient, dict[str, str]]]:
    """An InferenceClient (no retry backoff, model "m" unless given) over servers `names` answered by
    `handler`, after URLs named `refused` that nobody serves; yields it with name -> URL, closes both after."""
    async with serving(handler, names) as served:
        urls = {**{name: refused_url() for name in refused}, **served}
        options = {"model": "m", "backoff": 0.0, **kwargs}
        async with contextlib.aclosing(make_client(list(urls.values()), **options)) as client:
            yield client, urls

"""The inference client's server pool: which server answers, whether it is up, and the HTTP exchange with it.

- Routing: least requests in flight; a `session_id` sticks to one server so a multi-turn rollout keeps
  hitting its prefix cache (it moves only if that server goes down). With disaggregated serving the prefill
  servers are a pool of their own, with sessions of their own.
- Failures: a dropped connection takes the server out of rotation and the request is retried on another
  one, with exponential backoff, at most `max_retries` times; a 4xx is the caller's fault and raises
  `RequestRejected` at once; anything else ends as `ServerFailed` or `NoHealthyServer`.
- Health watch: polls `/health` of the servers that answered no request in the last interval; a server
  that answers again goes through `on_return` before it is put back (the weight fan-out brings it to the
  latest published weights there, so it never serves a stale policy).
"""

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from tidal.inference.disagg import Prefill, decode_body
from tidal.inference.errors import InferenceError, NoHealthyServer, RequestRejected, ServerFailed
from tidal.inference.http_workers import HttpWorkerDied
from tidal.inference.routing import LeastLoaded, ServerState

if TYPE_CHECKING:
    from tidal.config.rl import ClientConfig

logger = logging.getLogger(__name__)

# A proxy or a server that is starting/stopping; worth trying elsewhere.
TRANSIENT_STATUS = frozenset({502, 503, 504})
MAX_SESSIONS = 65_536
# Connection refused or reset, a server that hung up mid-answer, a truncated body: the server is gone.
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
# What any request to a server may raise besides the client's own errors (a timeout is not a dead server).
HTTP_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


@dataclass(frozen=True)
class Reply:
    """A server's whole answer."""

    status: int
    body: bytes
    parsed: Any = None
    """The answer already parsed (an HTTP worker's slim answer); else `json()` parses the body."""

    def json(self) -> Any:
        return json.loads(self.body) if self.parsed is None else self.parsed

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


Sender = Callable[[str, ServerState, str, dict[str, Any] | None], Awaitable[Reply]]
"""Sends one request (method, server, path, body) and returns the whole answer (the pool's own HTTP
session by default; the generation client's HTTP workers for generations)."""


@dataclass(frozen=True)
class PoolTuning:
    """The pool's knobs that no config section sets (tests and benchmarks change them)."""

    connect_timeout: float = 5.0
    max_retries: int = 3
    backoff: float = 0.5
    """Seconds before the first retry, doubled for each next one (with jitter)."""
    health_interval: float = 2.0


DEFAULT_TUNING = PoolTuning()


class ServerPool:
    """The servers of one client: routing, sessions, retries, health. `start` the health watch, `aclose` it."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        prefill_urls: Sequence[str] = (),
        timeout: float = 600.0,
        recovery_timeout: float = 0.0,
        tuning: PoolTuning = DEFAULT_TUNING,
    ):
        if not urls:
            raise ValueError("InferenceClient needs at least one server URL")
        prefill = [ServerState(url.rstrip("/")) for url in prefill_urls]
        decode = [ServerState(url.rstrip("/")) for url in urls]
        # every server, prefill ones first (as `tidal rl` numbers its replicas): admin calls go to all of them
        self.servers = {s.url: s for s in prefill + decode}
        self._least_loaded = LeastLoaded(decode)
        # Disaggregated serving: generations are prefilled on one of these, then decoded on the others.
        self.prefill_pool = LeastLoaded(prefill) if prefill else None
        self._prefill_sessions: OrderedDict[str, str] = OrderedDict()
        self.prefills_redone = 0
        """Decode requests sent without the prefill's KV, their server's weights not being the prefill
        server's (a weight update came between the two): the decode server prefilled again."""
        self.timeout = timeout
        self.connect_timeout = tuning.connect_timeout
        self.max_retries = tuning.max_retries
        self.backoff = tuning.backoff
        self.health_interval = tuning.health_interval
        # Seconds a request waits for a server to return while none is in rotation (a restarted replica).
        self.recovery_timeout = recovery_timeout
        # Like a read timeout: seconds without a byte from the server (vLLM answers a completion at its end).
        self._timeout = aiohttp.ClientTimeout(sock_connect=tuning.connect_timeout, sock_read=timeout)
        self._http: aiohttp.ClientSession | None = None  # made in the loop that first sends
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._watch: asyncio.Task[None] | None = None
        self._picks = 0
        self.on_return: Callable[[ServerState], Awaitable[None]] = self._readmit_as_is
        """What the health watch does with a server that answers /health again while out of rotation:
        `readmit` it, once brought up to date (the weight fan-out's `rejoin`)."""

    @classmethod
    def from_config(cls, config: "ClientConfig", tuning: PoolTuning = DEFAULT_TUNING) -> "ServerPool":
        return cls(
            config.urls,
            prefill_urls=config.prefill_urls,
            timeout=config.timeout,
            recovery_timeout=config.recovery_timeout,
            tuning=tuning,
        )

    def start(self) -> None:
        """Start the health watch (in the running loop)."""
        self._watch = asyncio.create_task(self._health_loop())

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            # aiohttp, not httpx: httpx's pool scans every connection for every request, which held the
            # event loop once thousands of requests were in flight (benchmarks/orchestrator_scale.py).
            # Keep-alive connections without a cap, like the servers' own request queues. No proxies from
            # the environment: these are the run's own servers.
            # Idle connections are dropped before uvicorn's (vLLM's server) 5 s keep-alive timeout, so one is
            # never reused just as the server closes it.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
            self._http = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._http

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """One HTTP exchange, the whole answer read; raises TRANSPORT_ERRORS or TimeoutError."""
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        all_headers = {"content-type": "application/json", **(headers or {})} if data is not None else headers
        per_request = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        async with self._session().request(
            method, url, data=data, headers=all_headers, timeout=per_request
        ) as response:
            return Reply(response.status, await response.read())

    async def _send(self, method: str, server: ServerState, path: str, body: dict[str, Any] | None) -> Reply:
        return await self.request(method, server.url + path, body)

    # ---- routing and retries ----------------------------------------------------------------------

    def pick(self, session_id: str | None = None, prefill: bool = False) -> ServerState:
        """The server for the next request: the session's own if it is up, else the least loaded (of the
        prefill servers for a prefill request, else of the others)."""
        pool, sessions = self._least_loaded, self._sessions
        if prefill:
            assert self.prefill_pool is not None
            pool, sessions = self.prefill_pool, self._prefill_sessions
        pinned = self.servers.get(sessions.get(session_id, "")) if session_id else None
        if pinned is not None and pinned.healthy:
            server: ServerState | None = pinned  # even while it updates: the episode's prefix is cached there
        else:
            server = pool.best()  # one that is not updating, if any
        if server is None:
            what = "prefill servers" if prefill else "inference servers"
            raise NoHealthyServer(f"none of {len(pool.servers)} {what} is healthy")
        self._picks += 1
        server.last_pick = self._picks
        if session_id is not None:
            sessions[session_id] = server.url
            sessions.move_to_end(session_id)
            if len(sessions) > MAX_SESSIONS:
                sessions.popitem(last=False)
        return server

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._prefill_sessions.pop(session_id, None)

    async def dispatch(
        self,
        path: str,
        body: dict[str, Any] | None,
        session_id: str | None,
        *,
        method: str = "POST",
        send: Sender | None = None,
        prefill: bool = False,
        prefilled: Prefill | None = None,
    ) -> tuple[str, int, Any]:
        """Send to a server, retrying elsewhere on transient failure; returns (url, version, json).
        `send`: how (default: this pool's HTTP session). `prefill`: to a prefill server; `prefilled`: a
        decode request, given the prefill's KV where the weights match."""
        failure = "no attempt made"
        wait_until = time.monotonic() + self.recovery_timeout
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                server = await self._pick_or_wait(session_id, wait_until, prefill)
            except NoHealthyServer as exc:
                failure = str(exc)
                continue
            if server.updating:  # the version must be the one that will answer: wait for the new one
                await server.idle.wait()
                if not server.healthy:  # it failed the update and left rotation meanwhile
                    failure = f"{server.url} left rotation during a weight update"
                    continue
            outcome = await self._try(server, method, path, body, send or self._send, prefilled)
            if isinstance(outcome, str):
                failure = outcome
                continue
            return outcome
        if "healthy" in failure:
            raise NoHealthyServer(f"{path}: {failure} (after {self.max_retries + 1} attempts)")
        raise ServerFailed(f"{path} failed {self.max_retries + 1} times; last: {failure}")

    async def _try(
        self,
        server: ServerState,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        send: Sender,
        prefilled: Prefill | None,
    ) -> tuple[str, int, Any] | str:
        """One attempt on `server`: (url, version, json), or why it failed and may be tried again."""
        version = server.version
        payload = body
        if prefilled is not None and body is not None:
            payload = decode_body(body, prefilled, version)
            self.prefills_redone += prefilled.version != version
        server.in_flight += 1
        try:
            response = await send(method, server, path, payload)
        except HttpWorkerDied as exc:  # not the server's fault: it stays in rotation
            return str(exc)
        except TimeoutError as exc:
            return f"{server.url}{path} timed out ({type(exc).__name__})"
        except TRANSPORT_ERRORS as exc:
            failure = f"{server.url}{path}: {type(exc).__name__}: {exc}"
            self.mark_down(server, failure)
            return failure
        finally:
            server.in_flight -= 1
        if response.status in TRANSIENT_STATUS:
            return f"{server.url}{path} answered {response.status}"
        if response.status >= 500 and not await self._answers_health(server):
            # a dying engine answers what it held with 500 ("EngineCore encountered an issue"): the
            # server is going away, not the request at fault, so it goes elsewhere or waits for one
            failure = f"{server.url}{path} answered {response.status} and then failed its health check"
            self.mark_down(server, failure)
            return failure
        if response.status < 500:
            server.answered_at = time.monotonic()
            server.joined = True
        return server.url, version, json_or_raise(response, server.url)

    async def _answers_health(self, server: ServerState) -> bool:
        try:
            return (await self.request("GET", server.url + "/health", timeout=5.0)).status == 200
        except HTTP_ERRORS:
            return False

    async def _pick_or_wait(self, session_id: str | None, until: float, prefill: bool = False) -> ServerState:
        """`pick`; while no server is in rotation, wait for the health watch to bring one back, until `until`
        (time.monotonic) at most."""
        while True:
            try:
                return self.pick(session_id, prefill)
            except NoHealthyServer:
                if time.monotonic() >= until:
                    raise
            await asyncio.sleep(0.1)

    def mark_down(self, server: ServerState, reason: str) -> None:
        if server.healthy:
            logger.warning("inference server %s out of rotation: %s", server.url, reason)
        server.healthy = False

    # ---- health ------------------------------------------------------------------------------------

    async def check_health(self) -> dict[str, bool]:
        """Probe every server once now (the watch probes the quiet ones every `health_interval` seconds)."""
        await asyncio.gather(*(self._probe(s) for s in self.servers.values()))
        return {url: s.healthy for url, s in self.servers.items()}

    async def wait_healthy(self, timeout: float, count: int | None = None) -> None:
        """Wait until `count` servers (default: all) answer /health."""
        needed = len(self.servers) if count is None else count
        deadline = time.monotonic() + timeout
        while sum((await self.check_health()).values()) < needed:
            if time.monotonic() > deadline:
                raise NoHealthyServer(f"fewer than {needed} inference servers healthy after {timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self._watch_round()
            except Exception:  # the watch must outlive any single bad probe
                logger.exception("inference health check failed")
            await asyncio.sleep(self.health_interval)

    async def _watch_round(self) -> None:
        """Probe the servers that answered nothing in the last interval: one that is answering requests is
        up, and at hundreds of servers the probes of busy ones would cost the loop as much as real work."""
        quiet_since = time.monotonic() - self.health_interval
        await asyncio.gather(
            *(
                self._probe(s)
                for s in self.servers.values()
                if not (s.healthy and s.answered_at > quiet_since)
            )
        )

    async def _probe(self, server: ServerState) -> None:
        if not await self._answers_health(server):
            if server.joined:
                self.mark_down(server, "health check failed")
            else:  # still starting: nothing was lost, so nothing to warn about
                server.healthy = False
        elif not server.healthy:
            await self.on_return(server)
        else:
            server.joined = True

    def readmit(self, server: ServerState) -> None:
        """Put a server that answers /health (and is up to date) back in rotation."""
        if server.joined:
            logger.warning("inference server %s back in rotation (version %d)", server.url, server.version)
        else:
            logger.info("inference server %s up (version %d)", server.url, server.version)
        server.healthy = server.joined = True

    async def _readmit_as_is(self, server: ServerState) -> None:
        self.readmit(server)


async def attempt(call: Awaitable[Any]) -> str | None:
    """Await one server's call; its error as text (None: it succeeded)."""
    try:
        await call
    except (InferenceError, *HTTP_ERRORS) as exc:
        return str(exc) or type(exc).__name__
    return None


def json_or_raise(response: Reply, url: str) -> Any:
    if response.status >= 400:
        message = _error_message(response)
        if response.status < 500:
            raise RequestRejected(response.status, message, url)
        raise ServerFailed(f"{url} answered {response.status}: {message}")
    try:
        return response.json() if response.body or response.parsed is not None else None
    except ValueError:  # some vLLM routes answer plain text (e.g. "Success: LoRA adapter ... added")
        return response.text


def _error_message(response: Reply) -> str:
    try:
        found = response.json()
        error = found.get("error", found)
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        return response.text[:500]
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]

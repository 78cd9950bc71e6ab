"""Async client over several vLLM servers (data parallel): routing, retries, health watch, weight fan-out.

- Routing: least requests in flight; a `session_id` sticks to one server so a multi-turn rollout keeps
  hitting its prefix cache (it moves only if that server goes down).
- Failures: a dropped connection takes the server out of rotation and the request is retried on another
  one, with exponential backoff, at most `max_retries` times; a 4xx is the caller's fault and raises
  `RequestRejected` at once; anything else ends as `ServerFailed` or `NoHealthyServer`.
- Health watch: polls `/health` of the servers that answered no request in the last interval; a server
  that answers again is brought to the latest published weights (and LoRA adapters) before it is put
  back, so it never serves a stale policy.
- Weight updates: pause (draining in-flight requests by default), load, resume, on every server at once,
  through vLLM's native RL routes; the report gives each server's version.
- LoRA policy updates (`update_adapter`): each version's adapter is hot-loaded under its own name
  (`/v1/load_lora_adapter`) and becomes the `model` of requests that name none. No pause: a request names
  its adapter, so one already running finishes on the adapter it started with and its version is exact.
  An older adapter is unloaded once no request of this client uses it.
- Prefill/decode disaggregation (`prefill_urls`): each generation is prefilled on a prefill server and
  decoded on a decode server with the KV it computed (tidal.inference.disagg); sessions stick to one server
  of each pool. Weight updates pause every server of both pools before any loads, empty a shared KV store
  (`kv_store`) while they all are paused, and take a server that failed to load out of rotation.
"""

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from tidal.inference.disagg import Prefill, decode_body, empty_store, prefill_body
from tidal.inference.guard import TOKEN_HEADER
from tidal.inference.http_workers import HttpWorkerDied, HttpWorkers, Slim
from tidal.inference.routes import decode_routes, routes_problem
from tidal.inference.routing import LeastLoaded, ServerState
from tidal.inference.types import (
    ChatRequest,
    Completion,
    GenerateRequest,
    Generation,
    ServerVersion,
    WeightUpdateReport,
)

logger = logging.getLogger(__name__)

PauseMode = Literal["wait", "keep", "abort"]
# A proxy or a server that is starting/stopping; worth trying elsewhere.
TRANSIENT_STATUS = frozenset({502, 503, 504})
MAX_SESSIONS = 65_536
# Connection refused or reset, a server that hung up mid-answer, a truncated body: the server is gone.
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
# What any request to a server may raise besides the client's own errors (a timeout is not a dead server).
HTTP_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


class InferenceError(Exception):
    """Base of the client's errors."""


class RequestRejected(InferenceError):
    """The server refused the request (4xx): fix the request, retrying will not help."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.status = status
        self.message = message


class ServerFailed(InferenceError):
    """A server error (5xx) or transport failure that persisted through every retry."""


class NoHealthyServer(InferenceError):
    """Every server is out of rotation."""


class RoutesMissing(ServerFailed):
    """Routing replay asked for the experts the model routed each token to, and an answer lacks them (a
    server without `--enable-return-routed-experts`, or routes that do not cover the tokens)."""


def is_infrastructure_error(exc: BaseException) -> bool:
    """Inference unreachable (or the work cancelled): not an environment's failure, so it must stop the
    run rather than be counted as one failed rollout."""
    return isinstance(exc, NoHealthyServer | ServerFailed | asyncio.CancelledError)


def parse_version(raw: object) -> int:
    """vLLM keeps versions as strings; before the first update it says "default", which is version 0."""
    try:
        return int(str(raw))
    except ValueError:
        return 0


class InferenceClient:
    """Use as `async with InferenceClient(urls) as client:` (starts and stops the health watch)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        admin_token: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        health_interval: float = 2.0,
        pause_mode: PauseMode = "wait",
        http_workers: int = 0,
        recovery_timeout: float = 0.0,
        require_routes: bool = False,
        prefill_urls: Sequence[str] = (),
        kv_store: str | Path | None = None,
    ):
        if not urls:
            raise ValueError("InferenceClient needs at least one server URL")
        prefill = [ServerState(url.rstrip("/")) for url in prefill_urls]
        decode = [ServerState(url.rstrip("/")) for url in urls]
        # every server, prefill ones first (as `tidal rl` numbers its replicas): admin calls go to all of them
        self.servers = {s.url: s for s in prefill + decode}
        self._least_loaded = LeastLoaded(decode)
        # Disaggregated serving: generations are prefilled on one of these, then decoded on the others.
        self._prefill_pool = LeastLoaded(prefill) if prefill else None
        self._prefill_sessions: OrderedDict[str, str] = OrderedDict()
        # ExampleConnector's directory: emptied while every server is paused for a weight update.
        self.kv_store = Path(kv_store) if kv_store is not None else None
        self.prefills_redone = 0
        """Decode requests sent without the prefill's KV, their server's weights not being the prefill
        server's (a weight update came between the two): the decode server prefilled again."""
        self.model = model
        self._card_read = False
        self._context_limit: int | None = None
        self.max_retries = max_retries
        self.backoff = backoff
        self.health_interval = health_interval
        self.pause_mode = pause_mode
        # Seconds a request waits for a server to return while none is in rotation (a restarted replica).
        self.recovery_timeout = recovery_timeout
        # Routing replay: an answer without the experts of every token stops the run (RoutesMissing).
        self.require_routes = require_routes
        self._admin_headers = {TOKEN_HEADER: admin_token} if admin_token else {}
        # Like a read timeout: seconds without a byte from the server (vLLM answers a completion at its end).
        self._timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout, sock_read=timeout)
        self._http: aiohttp.ClientSession | None = None  # made in the loop that first sends
        # Generation requests from worker processes (tidal.inference.http_workers); 0: from this loop.
        self._workers = HttpWorkers(http_workers, connect_timeout, timeout) if http_workers else None
        self._index = {url: i for i, url in enumerate(self.servers)}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._latest_weights: tuple[int, str] | None = None
        # One fan-out or catch-up at a time: a server re-admitted during a fan-out that skipped it would
        # otherwise come back with the weights from before that fan-out.
        self._weights_lock = asyncio.Lock()
        self._loras: dict[str, str] = {}
        # LoRA policy: name -> (version, path) of every policy adapter still loaded, the newest one serving
        # requests that name no model, and how many requests of this client use each one right now.
        self._policy_adapters: dict[str, tuple[int, str]] = {}
        self._policy_adapter: str | None = None
        self._adapter_requests: Counter[str] = Counter()
        self._watch: asyncio.Task[None] | None = None
        self._picks = 0

    async def __aenter__(self) -> "InferenceClient":
        self._watch = asyncio.create_task(self._health_loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._workers is not None:
            await self._workers.close()

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

    async def _request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> "Reply":
        """One HTTP exchange, the whole answer read; raises TRANSPORT_ERRORS or TimeoutError."""
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        all_headers = {"content-type": "application/json", **(headers or {})} if data is not None else headers
        per_request = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        async with self._session().request(
            method, url, data=data, headers=all_headers, timeout=per_request
        ) as response:
            return Reply(response.status, await response.read())

    # ---- generation -------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        """Token in, token out: sampled ids with their logprobs under the sampling distribution."""
        body = {
            "prompt": list(request.prompt_token_ids),
            "n": request.n,
            "logprobs": 0,
            "return_token_ids": True,
            **request.sampling.to_vllm(),
        }
        server, version, data = await self._send_generation(
            "/v1/completions", body, request.lora, session_id, "completions"
        )
        completions = tuple(_completion(c, c["logprobs"]["token_logprobs"]) for c in _choices(data))
        prompt_ids = tuple(data["choices"][0]["prompt_token_ids"])
        self._check_routes(server, prompt_ids, completions)
        self._count(server, completions)
        return Generation(
            prompt_token_ids=prompt_ids, completions=completions, server=server, weight_version=version
        )

    async def chat(self, request: ChatRequest, session_id: str | None = None) -> Generation:
        """Messages in (rendered by the server's chat template); prompt ids, completion ids, logprobs out.

        Continue a conversation with `tidal.rollout.chat.continue_prompt` and `generate`, not by sending
        the grown message list: re-rendering could tokenise the model's own earlier turns differently.
        """
        body = {
            "messages": [m.model_dump() for m in request.messages],
            "n": request.n,
            "logprobs": True,
            "return_token_ids": True,
            **request.sampling.to_vllm(),
        }
        server, version, data = await self._send_generation(
            "/v1/chat/completions", body, request.lora, session_id, "chat"
        )
        completions = tuple(
            _completion(
                {**c, "text": c["message"]["content"] or ""}, [t["logprob"] for t in c["logprobs"]["content"]]
            )
            for c in _choices(data)
        )
        prompt_ids = tuple(data["prompt_token_ids"])
        self._check_routes(server, prompt_ids, completions)
        self._count(server, completions)
        return Generation(
            prompt_token_ids=prompt_ids, completions=completions, server=server, weight_version=version
        )

    async def _send_generation(
        self, path: str, body: dict[str, Any], lora: str | None, session_id: str | None, shape: Slim
    ) -> tuple[str, int, Any]:
        """Dispatch with `model` set: the named adapter, else the LoRA policy's, else the base model.

        Returns (server, policy version, json): a policy adapter's version is its own, exactly.
        """
        model = lora or self._policy_adapter
        if model is None:
            return await self._generate(path, {"model": await self._model_name(), **body}, session_id, shape)
        with self._using_adapter(model):  # counted from here, with no await before: unloads respect it
            adapter_version = self._policy_adapters.get(model, (None, ""))[0]
            server, version, data = await self._generate(path, {"model": model, **body}, session_id, shape)
        return server, version if adapter_version is None else adapter_version, data

    async def _generate(
        self, path: str, body: dict[str, Any], session_id: str | None, shape: Slim
    ) -> tuple[str, int, Any]:
        """One generation: on one server, or disaggregated, prefilled on a prefill server first and decoded
        where its KV is handed over (the decode server's answer and version are the generation's)."""
        if self._prefill_pool is None:
            return await self._dispatch(path, body, session_id, shape)
        url, version, data = await self._dispatch(path, prefill_body(body), session_id, None, prefill=True)
        self._count(url, ())
        prefilled = Prefill(url, version, data.get("kv_transfer_params") if isinstance(data, dict) else None)
        return await self._dispatch(path, body, session_id, shape, prefilled=prefilled)

    def _check_routes(self, url: str, prompt_ids: Sequence[int], completions: Sequence[Completion]) -> None:
        """With `require_routes`, every completion must carry routes for all its tokens but the last."""
        if not self.require_routes:
            return
        for completion in completions:
            problem = routes_problem(completion.routed_experts, len(prompt_ids), len(completion.token_ids))
            if problem is not None:
                raise RoutesMissing(f"{url}: {problem}")

    def _count(self, url: str, completions: Sequence[Completion]) -> None:
        state = self.servers.get(url)
        if state is not None:
            state.requests += 1
            state.completion_tokens += sum(len(c.token_ids) for c in completions)

    @contextlib.contextmanager
    def _using_adapter(self, name: str) -> Iterator[None]:
        self._adapter_requests[name] += 1
        try:
            yield
        finally:
            self._adapter_requests[name] -= 1

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._prefill_sessions.pop(session_id, None)

    async def _model_name(self) -> str:
        if self.model is None:
            await self._read_model_card()
        assert self.model is not None
        return self.model

    async def context_limit(self) -> int | None:
        """The served model's context length in tokens (`max_model_len` on vLLM's /v1/models; every replica
        serves the same config), None where the server does not report it."""
        if not self._card_read:
            await self._read_model_card()
        return self._context_limit

    async def _read_model_card(self) -> None:
        _, _, data = await self._dispatch("/v1/models", None, None, None, method="GET")
        card = data["data"][0]
        if self.model is None:
            self.model = str(card["id"])
        limit = card.get("max_model_len")
        self._context_limit = int(limit) if isinstance(limit, int) and limit > 0 else None
        self._card_read = True

    # ---- routing and retries ----------------------------------------------------------------------

    def pick(self, session_id: str | None = None, prefill: bool = False) -> ServerState:
        """The server for the next request: the session's own if it is up, else the least loaded (of the
        prefill servers for a prefill request, else of the others)."""
        pool, sessions = self._least_loaded, self._sessions
        if prefill:
            assert self._prefill_pool is not None
            pool, sessions = self._prefill_pool, self._prefill_sessions
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

    async def _dispatch(
        self,
        path: str,
        body: dict[str, Any] | None,
        session_id: str | None,
        shape: Slim | None,
        method: str = "POST",
        prefill: bool = False,
        prefilled: Prefill | None = None,
    ) -> tuple[str, int, Any]:
        """Send to a server, retrying elsewhere on transient failure; returns (url, version, json).
        A generation request (`shape` set) goes through an HTTP worker when there are some. `prefill`: to a
        prefill server; `prefilled`: a decode request, given the prefill's KV where the weights match."""
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
            version = server.version
            payload = body
            if prefilled is not None and body is not None:
                payload = decode_body(body, prefilled, version)
                self.prefills_redone += prefilled.version != version
            server.in_flight += 1
            try:
                response = await self._send(method, server, path, payload, shape)
            except HttpWorkerDied as exc:  # not the server's fault: it stays in rotation
                failure = str(exc)
                continue
            except TimeoutError as exc:
                failure = f"{server.url}{path} timed out ({type(exc).__name__})"
                continue
            except TRANSPORT_ERRORS as exc:
                failure = f"{server.url}{path}: {type(exc).__name__}: {exc}"
                self.mark_down(server, failure)
                continue
            finally:
                server.in_flight -= 1
            if response.status in TRANSIENT_STATUS:
                failure = f"{server.url}{path} answered {response.status}"
                continue
            if response.status >= 500 and not await self._answers_health(server):
                # a dying engine answers what it held with 500 ("EngineCore encountered an issue"): the
                # server is going away, not the request at fault, so it goes elsewhere or waits for one
                failure = f"{server.url}{path} answered {response.status} and then failed its health check"
                self.mark_down(server, failure)
                continue
            if response.status < 500:
                server.answered_at = time.monotonic()
                server.joined = True
            return server.url, version, _json_or_raise(response, server.url)
        if "healthy" in failure:
            raise NoHealthyServer(f"{path}: {failure} (after {self.max_retries + 1} attempts)")
        raise ServerFailed(f"{path} failed {self.max_retries + 1} times; last: {failure}")

    async def _answers_health(self, server: ServerState) -> bool:
        try:
            return (await self._request("GET", server.url + "/health", timeout=5.0)).status == 200
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

    async def _send(
        self, method: str, server: ServerState, path: str, body: dict[str, Any] | None, shape: Slim | None
    ) -> "Reply":
        if self._workers is None or shape is None or body is None:
            return await self._request(method, server.url + path, body)
        status, raw, slim = await self._workers.post(self._index[server.url], server.url + path, body, shape)
        return Reply(status, raw, slim)

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
            async with self._weights_lock:
                if await self._catch_up(server):
                    if server.joined:
                        logger.warning(
                            "inference server %s back in rotation (version %d)", server.url, server.version
                        )
                    else:
                        logger.info("inference server %s up (version %d)", server.url, server.version)
                    server.healthy = server.joined = True
        else:
            server.joined = True

    async def _catch_up(self, server: ServerState) -> bool:
        """Bring a returning server to the latest weights and adapters; False if that failed."""
        try:
            reported = await self._read_version(server)
            # A server that cannot tell its version gets the latest weights again (loading is idempotent).
            server.version = 0 if reported is None else reported
            if self._latest_weights is not None and (reported is None or reported != self._latest_weights[0]):
                version, path = self._latest_weights
                result = await self._update_one(server, path, version)
                if not result.ok:
                    return False
            loras = {**self._loras, **{name: path for name, (_, path) in self._policy_adapters.items()}}
            for name, path in loras.items():
                await self._load_adapter(server, name, path)
        except (InferenceError, *HTTP_ERRORS) as exc:
            logger.warning(
                "inference server %s is up but could not be brought up to date: %s", server.url, exc
            )
            return False
        return True

    # ---- admin: weights, versions, pause, LoRA -----------------------------------------------------

    async def update_weights(self, path: str | Path, version: int) -> WeightUpdateReport:
        """Load HF safetensors from `path` (visible to every server) as `version`, on every healthy server.

        Servers that are down now are updated by the health watch before they return to rotation.
        """
        async with self._weights_lock:
            asked = any(s.healthy for s in self.servers.values())
            if self._prefill_pool is not None:
                results = await self._update_together(str(path), version)
            else:
                results = await asyncio.gather(
                    *(self._update_or_skip(s, str(path), version) for s in self.servers.values())
                )
            # A path that every server refused must not be replayed on returning ones; one that no server
            # was in rotation to load is what they load when they return.
            if any(r.ok for r in results) or not asked:
                self._latest_weights = (version, str(path))
            return WeightUpdateReport(version=version, path=str(path), servers=tuple(results))

    async def _update_or_skip(self, server: ServerState, path: str, version: int) -> ServerVersion:
        if not server.healthy:
            return ServerVersion(
                url=server.url, version=None, ok=False, error="out of rotation; updated on return"
            )
        return await self._update_one(server, path, version)

    async def _update_one(self, server: ServerState, path: str, version: int) -> ServerVersion:
        """Pause, load, resume one server. While it updates, the client sends new requests to the other
        replicas or holds them (a session pinned to it), and records the new version before resuming: every
        request sent after the update then names the weights that answer it, so a rollout's version is its
        replica's, exactly, even while replicas load a step at different times."""
        start = time.perf_counter()
        server.updating = True
        server.idle.clear()
        try:
            await self.pause(server)
            try:
                await self._load(server, path, version)
                server.version = version
            finally:
                await self.resume(server)
            reported = await self._read_version(server)
            server.version = version if reported is None else reported
        except (InferenceError, *HTTP_ERRORS) as exc:
            seconds = time.perf_counter() - start
            return ServerVersion(url=server.url, version=None, ok=False, error=str(exc), seconds=seconds)
        finally:
            server.updating = False
            server.idle.set()
        ok = server.version == version
        server.weight_updates += ok
        return ServerVersion(
            url=server.url, version=server.version, ok=ok, seconds=time.perf_counter() - start
        )

    async def _update_together(self, path: str, version: int) -> list[ServerVersion]:
        """Disaggregated serving: pause every server in rotation, empty the shared KV store, load on each,
        resume them all. KV that a prefill server computed with the old weights is then neither in the store
        nor handed to a decode server with the new ones (`decode_body` compares versions). A server that did
        not load the new weights leaves rotation before it resumes: the health watch brings it back on them.
        """
        start = time.perf_counter()
        servers = [s for s in self.servers.values() if s.healthy]
        for server in servers:
            server.updating = True
            server.idle.clear()
        errors: dict[str, str] = {}
        try:
            paused = await asyncio.gather(*(_attempt(self.pause(s)) for s in servers))
            errors.update({s.url: e for s, e in zip(servers, paused, strict=True) if e is not None})
            if self.kv_store is not None:
                removed = await asyncio.to_thread(empty_store, self.kv_store)
                logger.info(
                    "emptied the KV store %s (%d prompts) for version %d", self.kv_store, removed, version
                )
            ready = [s for s in servers if s.url not in errors]
            loaded = await asyncio.gather(*(_attempt(self._load(s, path, version)) for s in ready))
            for server, error in zip(ready, loaded, strict=True):
                if error is None:
                    server.version = version
                else:
                    errors[server.url] = error
        finally:
            for server in servers:
                if server.url in errors:
                    self.mark_down(server, f"weight update to version {version} failed: {errors[server.url]}")
            resumed = await asyncio.gather(*(_attempt(self.resume(s)) for s in servers))
            for server, error in zip(servers, resumed, strict=True):
                if error is not None and server.url not in errors:
                    errors[server.url] = error
                    self.mark_down(server, f"did not resume after the weight update: {error}")
                server.updating = False
                server.idle.set()
        seconds = time.perf_counter() - start
        results = []
        for server in self.servers.values():  # in the servers' order, as the fan-out of `_update_one`
            if server not in servers:
                results.append(ServerVersion(
                    url=server.url, version=None, ok=False, error="out of rotation; updated on return"
                ))  # fmt: skip
                continue
            ok = server.url not in errors
            server.weight_updates += ok
            results.append(ServerVersion(
                url=server.url, version=version if ok else None, ok=ok, error=errors.get(server.url),
                seconds=seconds,
            ))  # fmt: skip
        return results

    async def _load(self, server: ServerState, path: str, version: int) -> None:
        try:
            await self._admin(server, "/start_weight_update")
        except (InferenceError, *HTTP_ERRORS):
            # vLLM refuses a second session while one is open: a client that died mid-update (a killed
            # orchestrator, restarted since) left it so. Close it and start again; a server that is down
            # fails the retry too.
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):
                await self._admin(server, "/finish_weight_update")
            await self._admin(server, "/start_weight_update")
        try:
            await self._admin(server, "/update_weights", {"update_info": {"path": path}})
        except BaseException:
            # Close the worker's update session (filesystem engine: nothing was loaded yet) so the next
            # update can start; the version stays the old one.
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):
                await self._admin(server, "/finish_weight_update")
            raise
        await self._admin(server, "/finish_weight_update", {"weight_version": str(version)})

    async def reclaim(self) -> None:
        """Take the servers over from a client that died mid-update (a killed orchestrator, restarted): resume
        on every healthy server the generation it may have left paused. (A weight-update session it left
        open is closed by the next update, `_load`; the version it left behind still asks for one.)"""

        async def one(server: ServerState) -> None:
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):  # one going down is the health watch's
                await self.resume(server)

        await asyncio.gather(*(one(s) for s in self.servers.values() if s.healthy))

    async def pause(self, server: ServerState, mode: PauseMode | None = None) -> None:
        """New requests queue until `resume`; `wait` lets in-flight ones finish first, `keep` freezes them."""
        await self._admin(server, f"/pause?mode={mode or self.pause_mode}")

    async def resume(self, server: ServerState) -> None:
        await self._admin(server, "/resume")

    async def versions(self) -> dict[str, int | None]:
        """Each server's weight version as it reports it (as the client recorded it on vLLM without
        `/weight_info`; None if the server cannot be reached)."""

        async def one(server: ServerState) -> int | None:
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):
                reported = await self._read_version(server)
                return server.version if reported is None else reported
            return None

        found = await asyncio.gather(*(one(s) for s in self.servers.values()))
        return dict(zip(self.servers, found, strict=True))

    async def load_lora(self, name: str, path: str | Path) -> None:
        """Hot-load (or replace) LoRA adapter `name` on every server; generate with `lora=name`."""
        self._loras[name] = str(path)
        await asyncio.gather(
            *(self._load_adapter(s, name, str(path)) for s in self.servers.values() if s.healthy)
        )

    async def update_adapter(self, name: str, path: str | Path, version: int) -> WeightUpdateReport:
        """Make the LoRA adapter at `path` (PEFT format, visible to every server) policy `version`.

        It is loaded on every healthy server as `name` (one name per version), then requests that name no
        model use it. Servers that are down now load it before they return to rotation.
        """
        async with self._weights_lock:
            asked = any(s.healthy for s in self.servers.values())
            results = await asyncio.gather(
                *(self._adapter_or_skip(s, name, str(path), version) for s in self.servers.values())
            )
            if any(r.ok for r in results) or not asked:
                self._policy_adapters[name] = (version, str(path))
                self._policy_adapter = name
                await self._unload_unused_adapters()
            return WeightUpdateReport(version=version, path=str(path), servers=tuple(results))

    async def _adapter_or_skip(
        self, server: ServerState, name: str, path: str, version: int
    ) -> ServerVersion:
        if not server.healthy:
            return ServerVersion(
                url=server.url, version=None, ok=False, error="out of rotation; loaded on return"
            )
        start = time.perf_counter()
        try:
            await self._load_adapter(server, name, path)
        except (InferenceError, *HTTP_ERRORS) as exc:
            seconds = time.perf_counter() - start
            error = str(exc)
            if isinstance(exc, RequestRejected) and exc.status == 404:  # vLLM mounts the route only with LoRA
                error += " (is LoRA enabled there? inference.vllm.enable_lora = true)"
            return ServerVersion(url=server.url, version=None, ok=False, error=error, seconds=seconds)
        server.weight_updates += 1
        return ServerVersion(url=server.url, version=version, ok=True, seconds=time.perf_counter() - start)

    async def _load_adapter(self, server: ServerState, name: str, path: str) -> None:
        # load_inplace: loading a name the server already has (a server that only looked down) is not an error
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._admin(server, "/v1/load_lora_adapter", body)

    async def _unload_unused_adapters(self) -> None:
        """Unload the older policy adapters no request uses; one still in use waits for the next update."""
        for name in list(self._policy_adapters):
            if name == self._policy_adapter or self._adapter_requests[name] > 0:
                continue
            del self._policy_adapters[name]
            self._adapter_requests.pop(name, None)
            for server in self.servers.values():
                if not server.healthy:
                    continue  # a returning server loads only the adapters still listed
                try:
                    await self._admin(server, "/v1/unload_lora_adapter", {"lora_name": name})
                except (InferenceError, *HTTP_ERRORS) as exc:  # a stale adapter costs memory, not results
                    logger.warning("could not unload LoRA adapter %s from %s: %s", name, server.url, exc)

    def loaded_adapters(self) -> list[str]:
        """Policy adapters this client keeps loaded, oldest first (the last one serves new requests)."""
        return sorted(self._policy_adapters, key=lambda name: self._policy_adapters[name][0])

    async def _read_version(self, server: ServerState) -> int | None:
        """The version the server reports; None where vLLM has no `/weight_info` (0.26 and older)."""
        response = await self._request("GET", server.url + "/weight_info", timeout=10.0)
        if response.status == 404:
            return None
        return parse_version(_json_or_raise(response, server.url)["weight_version"])

    async def _admin(self, server: ServerState, path: str, body: dict[str, Any] | None = None) -> Any:
        response = await self._request("POST", server.url + path, body, headers=self._admin_headers)
        return _json_or_raise(response, server.url)


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


async def _attempt(call: Awaitable[Any]) -> str | None:
    """Await one server's admin call; its error as text (None: it succeeded)."""
    try:
        await call
    except (InferenceError, *HTTP_ERRORS) as exc:
        return str(exc) or type(exc).__name__
    return None


def _json_or_raise(response: Reply, url: str) -> Any:
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


def _choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(data["choices"], key=lambda c: c["index"])


def _completion(choice: dict[str, Any], logprobs: Sequence[float]) -> Completion:
    # The model validates and converts (lists to tuples, ints to floats) faster than Python loops would.
    routes = choice.get("routed_experts")
    return Completion(
        token_ids=choice["token_ids"],
        logprobs=logprobs,
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        routed_experts=None if routes is None else decode_routes(routes),
    )

"""The inference client's weight fan-out: each new policy onto every server of the pool.

- Full weights (`load_step`): pause (draining in-flight requests by default), load, resume, on every server
  at once, through vLLM's native RL routes (`ServerAdmin`: one call to one server each); the report gives
  each server's version.
- LoRA policy updates (`load_adapter_step`): each version's adapter is hot-loaded under its own name
  (`/v1/load_lora_adapter`) and becomes the `model` of requests that name none (`PolicyAdapters`). No
  pause: a request names its adapter, so one already running finishes on the adapter it started with and
  its version is exact. An older adapter is unloaded once no request of this client uses it.
- Catch-up: a server that answers the pool's health watch again is brought to the latest published weights
  (and LoRA adapters) before it is put back, so it never serves a stale policy.
- Prefill/decode disaggregation (the pool has prefill servers): a weight update pauses every server of both
  pools before any loads, empties a shared KV store (`kv_store`) while they all are paused, and takes a
  server that failed to load out of rotation.
"""

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tidal.inference.disagg import empty_store
from tidal.inference.errors import InferenceError, RequestRejected
from tidal.inference.guard import TOKEN_HEADER
from tidal.inference.load_route import ROUTE as LOAD_ROUTE
from tidal.inference.load_route import update_session
from tidal.inference.pool import HTTP_ERRORS, ServerPool, attempt, json_or_raise
from tidal.inference.routing import ServerState
from tidal.inference.types import ServerVersion, WeightUpdateReport

if TYPE_CHECKING:
    from tidal.config.rl import ClientConfig

logger = logging.getLogger(__name__)

PauseMode = Literal["wait", "keep", "abort"]
LEFT_OUT = "out of rotation; updated on return"


def parse_version(raw: object) -> int:
    """vLLM keeps versions as strings; before the first update it says "default", which is version 0."""
    try:
        return int(str(raw))
    except ValueError:
        return 0


class ServerAdmin:
    """vLLM's admin routes on one server, one HTTP call each (no retries: the fan-out decides what a failure
    means), with the admin token."""

    def __init__(self, pool: ServerPool, admin_token: str | None = None):
        self.pool = pool
        self._headers = {TOKEN_HEADER: admin_token} if admin_token else {}
        self._without_weight_info: set[str] = set()
        self._without_load_route: set[str] = set()

    async def post(self, server: ServerState, path: str, body: dict[str, Any] | None = None) -> Any:
        response = await self.pool.request("POST", server.url + path, body, headers=self._headers)
        return json_or_raise(response, server.url)

    async def post_pause(self, server: ServerState, mode: PauseMode) -> None:
        """New requests queue until `resume`; `wait` lets in-flight ones finish first, `keep` freezes them."""
        await self.post(server, f"/pause?mode={mode}")

    async def post_load_weights(
        self, server: ServerState, path: str, version: int, mode: PauseMode
    ) -> dict[str, float] | None:
        """The whole update in one request (`tidal.inference.load_route`, served by tidal's guard): the
        server's seconds per phase. None where the server lacks the route (a vLLM started without tidal's
        guard): the caller then makes the five calls itself, and this server is not asked again."""
        if server.url in self._without_load_route:
            return None
        body = {"update_info": {"path": path}, "weight_version": str(version), "pause_mode": mode}
        response = await self.pool.request("POST", server.url + LOAD_ROUTE, body, headers=self._headers)
        if response.status == 404:
            self._without_load_route.add(server.url)
            return None
        seconds = json_or_raise(response, server.url).get("seconds", {})
        return {str(k): float(v) for k, v in seconds.items()}

    async def post_resume(self, server: ServerState) -> None:
        await self.post(server, "/resume")

    async def post_load_lora_adapter(self, server: ServerState, name: str, path: str) -> None:
        # load_inplace: loading a name the server already has (a server that only looked down) is not an error
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self.post(server, "/v1/load_lora_adapter", body)

    async def post_unload_lora_adapter(self, server: ServerState, name: str) -> None:
        await self.post(server, "/v1/unload_lora_adapter", {"lora_name": name})

    async def get_weight_version(self, server: ServerState) -> int | None:
        """The version the server reports; None where vLLM has no `/weight_info` (0.26 and older). A server
        that answered 404 once is not asked again: each weight update would otherwise spend a round trip on
        it while the server's new requests wait."""
        if server.url in self._without_weight_info:
            return None
        response = await self.pool.request("GET", server.url + "/weight_info", timeout=10.0)
        if response.status == 404:
            self._without_weight_info.add(server.url)
            return None
        return parse_version(json_or_raise(response, server.url)["weight_version"])


class PolicyAdapters:
    """LoRA policy: name -> (version, path) of every policy adapter still loaded, the newest one (`current`)
    serving requests that name no model, and how many requests of this client use each one right now."""

    def __init__(self) -> None:
        self.loaded: dict[str, tuple[int, str]] = {}
        self.current: str | None = None
        self._requests: Counter[str] = Counter()

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Count a request on adapter `name` while it runs (an adapter in use is not unloaded)."""
        self._requests[name] += 1
        try:
            yield
        finally:
            self._requests[name] -= 1

    def serve(self, name: str, version: int, path: str) -> None:
        self.loaded[name] = (version, path)
        self.current = name

    def drop_if_unused(self, name: str) -> bool:
        """Forget adapter `name` if it is an older one that no request uses (True: forgotten)."""
        if name == self.current or self._requests[name] > 0:
            return False
        del self.loaded[name]
        self._requests.pop(name, None)
        return True


class WeightFanOut:
    """Loads each new policy on every server of `pool`, and catches up a server that returns behind."""

    def __init__(
        self,
        pool: ServerPool,
        *,
        admin_token: str | None = None,
        pause_mode: PauseMode = "wait",
        kv_store: str | Path | None = None,
    ):
        self.pool = pool
        self.admin = ServerAdmin(pool, admin_token)
        self.pause_mode = pause_mode
        # ExampleConnector's directory: emptied while every server is paused for a weight update.
        self.kv_store = Path(kv_store) if kv_store is not None else None
        self.adapters = PolicyAdapters()
        self._latest_weights: tuple[int, str] | None = None
        self._loras: dict[str, str] = {}
        self.phase_seconds: dict[str, float] = {}
        """Seconds per phase (pause, start, update, finish, resume) of the updates servers ran in one request,
        summed over servers and updates: what an update costs inside the servers, against its round trip."""
        # One fan-out or catch-up at a time: a server re-admitted during a fan-out that skipped it would
        # otherwise come back with the weights from before that fan-out.
        self._lock = asyncio.Lock()
        pool.on_return = self.rejoin  # a returning server loads the latest policy before it serves

    @classmethod
    def from_config(
        cls, pool: ServerPool, config: "ClientConfig", max_async_level: int = 0
    ) -> "WeightFanOut":
        """`admin_token` defaults to TIDAL_ADMIN_TOKEN, as the config says; the pause mode is the config's,
        `auto` resolved for an orchestrator whose bound is `max_async_level`."""
        return cls(
            pool,
            admin_token=config.admin_token or os.environ.get("TIDAL_ADMIN_TOKEN"),
            pause_mode=config.pause_mode(max_async_level),
            kv_store=config.kv_store,
        )

    # ---- full weights ------------------------------------------------------------------------------

    async def load_step(self, path: str | Path, version: int) -> WeightUpdateReport:
        """Load HF safetensors from `path` (visible to every server) as `version`, on every healthy server.

        Servers that are down now are updated by the health watch before they return to rotation.
        """
        async with self._lock:
            servers = self.pool.servers.values()
            asked = any(s.healthy for s in servers)
            if self.pool.prefill_pool is not None:
                results = await self._load_together(str(path), version)
            else:
                results = await asyncio.gather(*(self._load_or_skip(s, str(path), version) for s in servers))
            # A path that every server refused must not be replayed on returning ones; one that no server
            # was in rotation to load is what they load when they return.
            if any(r.ok for r in results) or not asked:
                self._latest_weights = (version, str(path))
            return WeightUpdateReport(version=version, path=str(path), servers=tuple(results))

    async def _load_or_skip(self, server: ServerState, path: str, version: int) -> ServerVersion:
        if not server.healthy:
            return ServerVersion(url=server.url, version=None, ok=False, error=LEFT_OUT)
        return await self._load_one(server, path, version)

    async def _load_one(self, server: ServerState, path: str, version: int) -> ServerVersion:
        """Pause, load, resume one server. While it updates, the client sends new requests to the other
        replicas or holds them (a session pinned to it), and records the new version before resuming: every
        request sent after the update then names the weights that answer it, so a rollout's version is its
        replica's, exactly, even while replicas load a step at different times."""
        start = time.perf_counter()
        server.updating = True
        server.idle.clear()
        try:
            phases = await self.admin.post_load_weights(server, path, version, self.pause_mode)
            if phases is None:
                await self._pause_load_resume(server, path, version)
            else:
                self.add_phases(phases)
            server.version = version
            reported = await self.admin.get_weight_version(server)
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

    async def _pause_load_resume(self, server: ServerState, path: str, version: int) -> None:
        """The update as five calls from here, for a server without tidal's one-request route."""
        await self.admin.post_pause(server, self.pause_mode)
        try:
            await self._load_weights_on(server, path, version)
        finally:
            await self.admin.post_resume(server)

    def add_phases(self, phases: dict[str, float]) -> None:
        """Add one server's update phases (the seconds it reported) to `phase_seconds`."""
        for phase, seconds in phases.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    async def _load_together(self, path: str, version: int) -> list[ServerVersion]:
        """Disaggregated serving: pause every server in rotation, empty the shared KV store, load on each,
        resume them all. KV that a prefill server computed with the old weights is then neither in the store
        nor handed to a decode server with the new ones (`decode_body` compares versions). A server that did
        not load the new weights leaves rotation before it resumes: the health watch brings it back on them.
        """
        start = time.perf_counter()
        servers = [s for s in self.pool.servers.values() if s.healthy]
        for server in servers:
            server.updating = True
            server.idle.clear()
        errors: dict[str, str] = {}
        try:
            await self._pause_and_load(servers, path, version, errors)
        finally:
            await self._resume_after_load(servers, version, errors)
        return self._together_report(servers, version, errors, time.perf_counter() - start)

    async def _pause_and_load(
        self, servers: list[ServerState], path: str, version: int, errors: dict[str, str]
    ) -> None:
        """Pause all of `servers`, empty the KV store, load on those that paused; failures into `errors`."""
        paused = await asyncio.gather(*(attempt(self.admin.post_pause(s, self.pause_mode)) for s in servers))
        errors.update({s.url: e for s, e in zip(servers, paused, strict=True) if e is not None})
        if self.kv_store is not None:
            removed = await asyncio.to_thread(empty_store, self.kv_store)
            logger.info(
                "emptied the KV store %s (%d prompts) for version %d", self.kv_store, removed, version
            )
        ready = [s for s in servers if s.url not in errors]
        loaded = await asyncio.gather(*(attempt(self._load_weights_on(s, path, version)) for s in ready))
        for server, error in zip(ready, loaded, strict=True):
            if error is None:
                server.version = version
            else:
                errors[server.url] = error

    async def _resume_after_load(
        self, servers: list[ServerState], version: int, errors: dict[str, str]
    ) -> None:
        """Take the servers that failed out of rotation, then resume every one of `servers`."""
        for server in servers:
            if server.url in errors:
                self.pool.mark_down(
                    server, f"weight update to version {version} failed: {errors[server.url]}"
                )
        resumed = await asyncio.gather(*(attempt(self.admin.post_resume(s)) for s in servers))
        for server, error in zip(servers, resumed, strict=True):
            if error is not None and server.url not in errors:
                errors[server.url] = error
                self.pool.mark_down(server, f"did not resume after the weight update: {error}")
            server.updating = False
            server.idle.set()

    def _together_report(
        self, servers: list[ServerState], version: int, errors: dict[str, str], seconds: float
    ) -> list[ServerVersion]:
        results = []
        for server in self.pool.servers.values():  # in the servers' order, as the fan-out of `_load_one`
            if server not in servers:
                results.append(ServerVersion(url=server.url, version=None, ok=False, error=LEFT_OUT))
                continue
            ok = server.url not in errors
            server.weight_updates += ok
            results.append(ServerVersion(
                url=server.url, version=version if ok else None, ok=ok, error=errors.get(server.url),
                seconds=seconds,
            ))  # fmt: skip
        return results

    async def _load_weights_on(self, server: ServerState, path: str, version: int) -> None:
        """One server's update session, call by call from here (the server is paused): the sequence tidal's
        guard runs for a server with the one-request route (`load_route.update_session`)."""

        async def call(phase: str, route: str, body: dict[str, Any] | None) -> None:
            await self.admin.post(server, route, body)

        update = {"update_info": {"path": path}}
        await update_session(call, update, str(version), (InferenceError, *HTTP_ERRORS))

    async def reclaim(self) -> None:
        """Take the servers over from a client that died mid-update (a killed orchestrator, restarted): resume
        on every healthy server the generation it may have left paused. (A weight-update session it left
        open is closed by the next update, `_load_weights_on`; the version it left behind still asks for
        one.)"""

        async def one(server: ServerState) -> None:
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):  # one going down is the health watch's
                await self.admin.post_resume(server)

        await asyncio.gather(*(one(s) for s in self.pool.servers.values() if s.healthy))

    async def versions(self) -> dict[str, int | None]:
        """Each server's weight version as it reports it (as the client recorded it on vLLM without
        `/weight_info`; None if the server cannot be reached)."""

        async def one(server: ServerState) -> int | None:
            with contextlib.suppress(InferenceError, *HTTP_ERRORS):
                reported = await self.admin.get_weight_version(server)
                return server.version if reported is None else reported
            return None

        found = await asyncio.gather(*(one(s) for s in self.pool.servers.values()))
        return dict(zip(self.pool.servers, found, strict=True))

    # ---- LoRA adapters -----------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str | Path) -> None:
        """Hot-load (or replace) LoRA adapter `name` on every server; generate with `lora=name`."""
        self._loras[name] = str(path)
        await asyncio.gather(
            *(
                self.admin.post_load_lora_adapter(s, name, str(path))
                for s in self.pool.servers.values()
                if s.healthy
            )
        )

    async def load_adapter_step(self, name: str, path: str | Path, version: int) -> WeightUpdateReport:
        """Make the LoRA adapter at `path` (PEFT format, visible to every server) policy `version`.

        It is loaded on every healthy server as `name` (one name per version), then requests that name no
        model use it. Servers that are down now load it before they return to rotation.
        """
        async with self._lock:
            servers = self.pool.servers.values()
            asked = any(s.healthy for s in servers)
            results = await asyncio.gather(
                *(self._adapter_or_skip(s, name, str(path), version) for s in servers)
            )
            if any(r.ok for r in results) or not asked:
                self.adapters.serve(name, version, str(path))
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
            await self.admin.post_load_lora_adapter(server, name, path)
        except (InferenceError, *HTTP_ERRORS) as exc:
            seconds = time.perf_counter() - start
            error = str(exc)
            if isinstance(exc, RequestRejected) and exc.status == 404:  # vLLM mounts the route only with LoRA
                error += " (is LoRA enabled there? inference.vllm.enable_lora = true)"
            return ServerVersion(url=server.url, version=None, ok=False, error=error, seconds=seconds)
        server.weight_updates += 1
        return ServerVersion(url=server.url, version=version, ok=True, seconds=time.perf_counter() - start)

    async def _unload_unused_adapters(self) -> None:
        """Unload the older policy adapters no request uses; one still in use waits for the next update."""
        for name in list(self.adapters.loaded):
            if not self.adapters.drop_if_unused(name):
                continue
            for server in self.pool.servers.values():
                if not server.healthy:
                    continue  # a returning server loads only the adapters still listed
                try:
                    await self.admin.post_unload_lora_adapter(server, name)
                except (InferenceError, *HTTP_ERRORS) as exc:  # a stale adapter costs memory, not results
                    logger.warning("could not unload LoRA adapter %s from %s: %s", name, server.url, exc)

    def loaded_adapters(self) -> list[str]:
        """Policy adapters this client keeps loaded, oldest first (the last one serves new requests)."""
        loaded = self.adapters.loaded
        return sorted(loaded, key=lambda name: loaded[name][0])

    # ---- catch-up ----------------------------------------------------------------------------------

    async def rejoin(self, server: ServerState) -> None:
        """The pool's `on_return`: readmit a server that answers again once it serves the latest policy."""
        async with self._lock:
            if await self.catch_up(server):
                self.pool.readmit(server)

    async def catch_up(self, server: ServerState) -> bool:
        """Bring a returning server to the latest weights and adapters; False if that failed."""
        try:
            reported = await self.admin.get_weight_version(server)
            # A server that cannot tell its version gets the latest weights again (loading is idempotent).
            server.version = 0 if reported is None else reported
            if self._latest_weights is not None and (reported is None or reported != self._latest_weights[0]):
                version, path = self._latest_weights
                result = await self._load_one(server, path, version)
                if not result.ok:
                    return False
            loras = {**self._loras, **{name: path for name, (_, path) in self.adapters.loaded.items()}}
            for name, path in loras.items():
                await self.admin.post_load_lora_adapter(server, name, path)
        except (InferenceError, *HTTP_ERRORS) as exc:
            logger.warning(
                "inference server %s is up but could not be brought up to date: %s", server.url, exc
            )
            return False
        return True

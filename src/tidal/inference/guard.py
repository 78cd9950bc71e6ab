"""ASGI middleware in front of vLLM's app: who may call which route (`--middleware` loads it in the server).

vLLM mounts its RL routes (pause, weight transfer) only in dev mode, which also mounts `/collective_rpc`,
`/sleep` and friends: remote code execution for anyone who reaches them. The policy is default-deny:

- public: health, model list, OpenAI generation, tokenisation, read-only status;
- admin: pause/resume, weight updates, LoRA loads — need the shared token whenever one is configured (and
  one must be, to bind beyond loopback);
- everything else (dev routes, docs, anything new in a later vLLM) answers 403 unless the server was
  started with `server.dev_routes`; then only to loopback clients, and once a token is configured only
  with it: other processes on the host (a rollout's sandboxed code, other users) reach loopback too.

It also checks an `/update_weights` body before it reaches the workers: `update_info` must be an object or
a list with an object per worker (vLLM indexes the list by worker rank and answers an empty or short one
with a 500, after which its update session is closed and the finish call fails too). A filesystem update's
directory is checked as well (the workers tear the model down before they read a file): safetensors
headers, names, shapes and dtypes against the checkpoint the server started from, and (unless turned off)
that every value is finite. A bad update is a 400 naming the problem and the old weights keep serving. If
a load still fails midway and the workers could not restore the previous weights (their error carries
`WEIGHTS_BROKEN`), the server answers 503 on `/health` and on generation until an update succeeds, so
clients and the launcher take it out of rotation.

`POST /tidal/load_weights` (admin) runs a whole weight update (pause, start, update, finish, resume) against
vLLM's app inside the server, in one request: `tidal.inference.load_route`. `POST /tidal/generate` (public)
runs a token-in request with pictures on vLLM's engine: `tidal.inference.picture_route`.

A chat request whose messages carry a role outside `CHAT_ROLES` is a 400 naming the message: vLLM would
pass it to the chat template, which renders an unknown role as nothing or as garbage, and answer 200.
"""

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config.inference import ADMIN_TOKEN_ENV, TOKEN_HEADER, is_loopback
from tidal.inference import load_route, picture_route
from tidal.transport.weight_checks import WEIGHTS_BROKEN, Reference, load_reference, update_problem

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BIND_HOST_ENV = "TIDAL_BIND_HOST"
WEIGHTS_BACKEND_ENV = "TIDAL_WEIGHTS_BACKEND"
REFERENCE_WEIGHTS_ENV = "TIDAL_REFERENCE_WEIGHTS"  # the model the server started from (dir or hub id)
CHECK_FINITE_ENV = "TIDAL_CHECK_FINITE"
DEV_ROUTES_ENV = "TIDAL_DEV_ROUTES"  # "1": `server.dev_routes`
NUM_WORKERS_ENV = "TIDAL_NUM_WORKERS"  # the server's model workers (tensor × data parallel)
logger = logging.getLogger(__name__)
# under vLLM's logger, so that its handler (the server's output) shows each update, as vLLM's access log
# showed each of the five calls the route replaces
update_log = logging.getLogger("vllm.tidal.load_weights")

PUBLIC_ROUTES = frozenset(
    {
        "/health",
        "/ping",
        "/version",
        "/load",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        picture_route.ROUTE,  # token in with pictures, served by this guard
        "/tokenize",
        "/detokenize",
        "/is_paused",
        "/weight_info",
        "/get_world_size",
    }
)
ADMIN_ROUTES = frozenset(
    {
        "/pause",
        "/resume",
        "/abort_requests",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        load_route.ROUTE,
    }
)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_problem(body: bytes) -> str | None:
    """Why a `/v1/chat/completions` body must not reach vLLM (a message role it would render wrongly), or
    None; a body that is not JSON is left for vLLM to refuse."""
    try:
        messages = json.loads(body or b"{}").get("messages")
    except (ValueError, AttributeError):
        return None
    if not isinstance(messages, list):
        return None
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            return f"messages[{index}].role: {role!r} is not one of {', '.join(CHAT_ROLES)}"
    return None


@dataclass(frozen=True)
class AccessPolicy:
    """The decision for one request, from the bind host and the admin token the server was started with."""

    bind_host: str
    admin_token: str | None
    dev_routes: bool = False

    @classmethod
    def from_env(cls) -> "AccessPolicy":
        return cls(
            os.environ.get(BIND_HOST_ENV, "127.0.0.1"),
            os.environ.get(ADMIN_TOKEN_ENV) or None,
            os.environ.get(DEV_ROUTES_ENV) == "1",
        )

    def check(self, path: str, client_host: str | None, token: str | None) -> tuple[int, str] | None:
        """None if allowed, else (HTTP status, reason)."""
        path = path.rstrip("/") or "/"
        if path in PUBLIC_ROUTES:
            return None
        if path in ADMIN_ROUTES:
            return self._check_admin(token)
        if not self.dev_routes:
            return 403, f"{path} is not served: vLLM's other routes need inference.server.dev_routes = true"
        if client_host is None or not is_loopback(client_host):
            return 403, f"{path} is only served to clients on the server's own host"
        if self.admin_token is not None and not self._token_matches(token):
            return 401, f"{path}: missing or wrong {TOKEN_HEADER} header"
        return None

    def _check_admin(self, token: str | None) -> tuple[int, str] | None:
        if self.admin_token is None:
            if is_loopback(self.bind_host):
                return None
            return 403, "admin routes are disabled: the server binds beyond loopback without an admin token"
        if not self._token_matches(token):
            return 401, f"admin route: missing or wrong {TOKEN_HEADER} header"
        return None

    def _token_matches(self, token: str | None) -> bool:
        expected = self.admin_token
        return (
            expected is not None
            and token is not None
            and hmac.compare_digest(token.encode(), expected.encode())
        )


class AdminGuard:
    """The middleware vLLM instantiates with the inner app (configured through environment variables)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.policy = AccessPolicy.from_env()
        self.check_paths = os.environ.get(WEIGHTS_BACKEND_ENV, "filesystem") == "filesystem"
        self.checks = UpdateChecks.from_env()
        workers = os.environ.get(NUM_WORKERS_ENV)
        self.num_workers = int(workers) if workers else None
        self.broken: str | None = None  # why this server must not serve (a load that failed midway)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        path = scope["path"].rstrip("/") or "/"
        denied = self.policy.check(path, client[0] if client else None, _header(scope, TOKEN_HEADER))
        if denied is not None:
            await _reply(send, *denied, kind="PermissionDenied")
            return
        if self.broken is not None and (path in ("/health", picture_route.ROUTE) or path.startswith("/v1/")):
            await _reply(send, 503, self.broken, kind="ServiceUnavailable")
            return
        if path == "/update_weights":
            await self._update_weights(scope, receive, send)
            return
        if path == load_route.ROUTE and scope.get("method") == "POST":
            await self._load_weights(scope, receive, send)
            return
        if path == picture_route.ROUTE and scope.get("method") == "POST":
            await self._generate_pictures(scope, receive, send)
            return
        if path == "/v1/chat/completions" and scope.get("method") == "POST":
            body = await _read_body(receive)
            problem = chat_problem(body)
            if problem is not None:
                await _reply(send, 400, problem, kind="BadRequestError")
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _load_weights(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`load_route.ROUTE`: the five calls of an update against vLLM's app, here, in one request."""
        parsed = load_route.parse_body(await _read_body(receive))
        if isinstance(parsed, str):
            await _reply(send, 400, parsed, kind="BadRequestError")
            return

        async def call(path: str, query: str, body: bytes) -> tuple[int, bytes]:
            return await self._internal(scope, path, query, body)

        update, version, mode = parsed
        try:
            seconds = await load_route.load_weights(call, update, version, mode)
        except load_route.PhaseFailed as exc:
            update_log.warning(
                "tidal: weight update to version %s (pause mode %s) failed: %s", version, mode, exc
            )
            await _reply(send, exc.status, str(exc), kind="WeightUpdateFailed")
            return
        phases = ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in seconds.items())
        update_log.info("tidal: weights version %s loaded (pause mode %s): %s", version, mode, phases)
        await _send_json(send, 200, {"weight_version": version, "seconds": seconds})

    async def _generate_pictures(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`picture_route.ROUTE`: token in with pictures on vLLM's engine (the app's state holds it)."""

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            request = picture_route.parse_body(await _read_body(receive))
            result = await picture_route.generate(scope["app"].state, request, client_left)
        except picture_route.PictureRequestError as exc:
            await _reply(send, 400, str(exc), kind="BadRequestError")
            return
        except picture_route.ClientLeft:
            return  # nobody to answer
        await _send_json(send, 200, result)

    async def _internal(self, scope: Scope, path: str, query: str, body: bytes) -> tuple[int, bytes]:
        """POST `path` to vLLM's app from inside this server (through this guard's `/update_weights` checks
        for that route): its status and body."""
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sub = {
            **scope,
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "method": "POST",
            "headers": headers,
        }
        status, chunks = 0, []

        async def collect(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        receive = _body_then_wait(body)
        if path == "/update_weights":
            await self._update_weights(sub, receive, collect)
        else:
            await self.app(sub, receive, collect)
        return status, b"".join(chunks)

    async def _update_weights(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method", "POST") == "POST":
            body = await _read_body(receive)
            problem = update_info_problem(body, self.num_workers)
            if problem is None and self.check_paths:
                # Reading every tensor takes about a second per GB: off the event loop, so /health answers.
                problem = await asyncio.to_thread(self.checks.problem, body)
            if problem is not None:
                await _reply(send, 400, problem, kind="BadRequestError")
                return
            receive = _replay(body, receive)
        status, reply = await _forward_watching(self.app, scope, receive, send)
        if status < 300:
            self.broken = None
        elif status >= 500 and WEIGHTS_BROKEN in reply:
            self.broken = (
                f"a weight update failed midway and the {WEIGHTS_BROKEN}: load good weights or restart"
            )
            logger.error("tidal guard: %s", self.broken)


@dataclass
class UpdateChecks:
    """What a filesystem update is checked against: the served checkpoint's headers (read once)."""

    reference_name: str | None
    check_finite: bool
    _reference: Reference | None = None
    _resolved: bool = False

    @classmethod
    def from_env(cls) -> "UpdateChecks":
        finite = os.environ.get(CHECK_FINITE_ENV, "1") not in ("0", "false", "False")
        return cls(os.environ.get(REFERENCE_WEIGHTS_ENV) or None, finite)

    def problem(self, body: bytes) -> str | None:
        """Why the `/update_weights` request in `body` must not reach the workers, or None."""
        from tidal.transport.weights import check_weights_dir

        paths, malformed = _update_paths(body)
        if malformed is not None:
            return malformed
        for path in paths:
            problem = check_weights_dir(path) or update_problem(
                Path(path), self.reference(), self.check_finite
            )
            if problem is not None:
                return problem
        return None

    def reference(self) -> Reference | None:
        if not self._resolved:
            self._resolved = True
            self._reference = load_reference(self.reference_name) if self.reference_name else None
            if self._reference is None:
                logger.warning(
                    "tidal guard: no local checkpoint for %s: updates are checked without names/shapes",
                    self.reference_name,
                )
        return self._reference


def _header(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key.decode("latin-1").lower() == name:
            return str(value.decode("latin-1"))
    return None


def update_info_problem(body: bytes, num_workers: int | None) -> str | None:
    """Why an `/update_weights` body must not reach vLLM, or None. `update_info` is one object for every
    worker, or a list that vLLM indexes by worker rank: an empty or short one fails there with a 500
    (IndexError) and closes the update session, so the finish call fails as well. `num_workers`: the
    server's workers (None: unknown, only emptiness is checked)."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or "update_info" not in parsed:
        return "body must be a JSON object with an `update_info` field"
    info = parsed["update_info"]
    if isinstance(info, dict):
        return None
    if not isinstance(info, list):
        return "`update_info` must be an object, or a list with an object per worker"
    if not info:
        return "`update_info` is an empty list: give an object, or a list with an object per worker"
    if num_workers is not None and len(info) < num_workers:
        return (
            f"`update_info` is a list of {len(info)} for this server's {num_workers} workers: give an object "
            "per worker (by rank), or one object for all"
        )
    for index, entry in enumerate(info):
        if not isinstance(entry, dict):
            return f"`update_info[{index}]` is not an object"
    return None


def _update_paths(body: bytes) -> tuple[list[str], str | None]:
    """The directories a filesystem `/update_weights` body names, or why the body is malformed."""
    try:
        update_info = json.loads(body or b"{}").get("update_info")
    except (ValueError, AttributeError):
        return [], "body must be a JSON object with an `update_info` field"
    infos = update_info if isinstance(update_info, list) else [update_info]
    paths = []
    for info in infos:
        path = info.get("path") if isinstance(info, dict) else None
        if not isinstance(path, str):
            return [], 'filesystem weight update needs `update_info` = {"path": "<dir of HF safetensors>"}'
        paths.append(path)
    return paths, None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _body_then_wait(body: bytes) -> Receive:
    """An internal request's receive: the body once, then never a disconnect (no client can leave)."""
    sent = False
    never = asyncio.Event()

    async def receive() -> MutableMapping[str, Any]:
        nonlocal sent
        if sent:
            await never.wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _replay(body: bytes, original: Receive) -> Receive:
    """Hand the already-read body to the app once; later calls wait for the real disconnect."""
    sent = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal sent
        if sent:
            return await original()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _forward_watching(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> tuple[int, str]:
    """Run the app, passing its response through; returns the status and (the start of) the body."""
    status, kept = 0, 0
    chunks: list[bytes] = []

    async def watch(message: MutableMapping[str, Any]) -> None:
        nonlocal status, kept
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body" and kept < 65536:
            chunks.append(bytes(message.get("body", b"")))
            kept += len(chunks[-1])
        await send(message)

    await app(scope, receive, watch)
    return status, b"".join(chunks).decode("utf-8", "replace")


async def _reply(send: Send, status: int, message: str, kind: str) -> None:
    await _send_json(send, status, {"error": {"message": message, "type": kind, "code": status}})


async def _send_json(send: Send, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

"""ASGI middleware in front of vLLM's app: who may call which route (`--middleware` loads it in the server).

vLLM mounts its RL routes (pause, weight transfer) only in dev mode, which also mounts `/collective_rpc`,
`/sleep` and friends: remote code execution for anyone who reaches them. The policy is default-deny:

- public: health, model list, OpenAI generation, tokenisation, read-only status;
- admin: pause/resume, weight updates, LoRA loads — need the shared token whenever one is configured (and
  one must be, to bind beyond loopback);
- everything else (dev routes, docs, anything new in a later vLLM) answers only to loopback clients.

It also checks a filesystem `/update_weights` path before it reaches the workers, so a typo is a 400
instead of a worker error.
"""

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from tidal.config.inference import ADMIN_TOKEN_ENV, is_loopback

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BIND_HOST_ENV = "TIDAL_BIND_HOST"
WEIGHTS_BACKEND_ENV = "TIDAL_WEIGHTS_BACKEND"
TOKEN_HEADER = "x-admin-token"

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
    }
)


@dataclass(frozen=True)
class AccessPolicy:
    """The decision for one request, from the bind host and the admin token the server was started with."""

    bind_host: str
    admin_token: str | None

    @classmethod
    def from_env(cls) -> "AccessPolicy":
        return cls(os.environ.get(BIND_HOST_ENV, "127.0.0.1"), os.environ.get(ADMIN_TOKEN_ENV) or None)

    def check(self, path: str, client_host: str | None, token: str | None) -> tuple[int, str] | None:
        """None if allowed, else (HTTP status, reason)."""
        path = path.rstrip("/") or "/"
        if path in PUBLIC_ROUTES:
            return None
        if path in ADMIN_ROUTES:
            return self._check_admin(token)
        if client_host is None or not is_loopback(client_host):
            return 403, f"{path} is only served to clients on the server's own host"
        return None

    def _check_admin(self, token: str | None) -> tuple[int, str] | None:
        if self.admin_token is None:
            if is_loopback(self.bind_host):
                return None
            return 403, "admin routes are disabled: the server binds beyond loopback without an admin token"
        if token is None or not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return 401, f"admin route: missing or wrong {TOKEN_HEADER} header"
        return None


class AdminGuard:
    """The middleware vLLM instantiates with the inner app (configured through environment variables)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.policy = AccessPolicy.from_env()
        self.check_paths = os.environ.get(WEIGHTS_BACKEND_ENV, "filesystem") == "filesystem"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        denied = self.policy.check(scope["path"], client[0] if client else None, _header(scope, TOKEN_HEADER))
        if denied is not None:
            await _reply(send, *denied, kind="PermissionDenied")
            return
        if self.check_paths and scope["path"].rstrip("/") == "/update_weights":
            body = await _read_body(receive)
            problem = _weights_path_problem(body)
            if problem is not None:
                await _reply(send, 400, problem, kind="BadRequestError")
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _header(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key.decode("latin-1").lower() == name:
            return str(value.decode("latin-1"))
    return None


def _weights_path_problem(body: bytes) -> str | None:
    from tidal.transport.weights import check_weights_dir

    try:
        update_info = json.loads(body or b"{}").get("update_info")
    except (ValueError, AttributeError):
        return "body must be a JSON object with an `update_info` field"
    infos = update_info if isinstance(update_info, list) else [update_info]
    for info in infos:
        path = info.get("path") if isinstance(info, dict) else None
        if not isinstance(path, str):
            return 'filesystem weight update needs `update_info` = {"path": "<dir of HF safetensors>"}'
        problem = check_weights_dir(path)
        if problem is not None:
            return problem
    return None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


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


async def _reply(send: Send, status: int, message: str, kind: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

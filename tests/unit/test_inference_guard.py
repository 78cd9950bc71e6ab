"""Access policy of the inference server's middleware, and its pre-check of weight-update paths."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tidal.inference.guard import AccessPolicy, AdminGuard

LOCAL, REMOTE = "127.0.0.1", "192.0.2.7"


def status(policy: AccessPolicy, path: str, client: str | None, token: str | None = None) -> int:
    denied = policy.check(path, client, token)
    return 200 if denied is None else denied[0]


def test_loopback_bind_without_token_keeps_dev_routes_local() -> None:
    policy = AccessPolicy(bind_host="127.0.0.1", admin_token=None)
    assert status(policy, "/pause", LOCAL) == 200
    assert status(policy, "/collective_rpc", LOCAL) == 200
    assert status(policy, "/v1/completions", REMOTE) == 200
    assert status(policy, "/collective_rpc", REMOTE) == 403


def test_dev_and_unknown_routes_are_local_only_even_with_the_token() -> None:
    policy = AccessPolicy(bind_host="0.0.0.0", admin_token="s3cret")
    for path in ("/collective_rpc", "/collective_rpc/", "/sleep", "/server_info", "/docs", "/something_new"):
        assert status(policy, path, REMOTE, "s3cret") == 403, path
    assert status(policy, "/collective_rpc", None, "s3cret") == 403  # unknown client address: not local


def test_admin_routes_need_the_token_once_one_is_set() -> None:
    policy = AccessPolicy(bind_host="0.0.0.0", admin_token="s3cret")
    for client in (LOCAL, REMOTE):
        assert status(policy, "/update_weights", client) == 401
        assert status(policy, "/pause", client, "wrong") == 401
        assert status(policy, "/pause", client, "s3cret") == 200
        assert status(policy, "/v1/load_lora_adapter", client, "s3cret") == 200
        assert status(policy, "/health", client) == 200
        assert status(policy, "/v1/chat/completions", client) == 200


def test_non_loopback_bind_without_token_disables_admin_routes() -> None:
    assert status(AccessPolicy(bind_host="0.0.0.0", admin_token=None), "/pause", LOCAL) == 403


async def _call(guard_app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    chunks = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:]},
    ]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "client": (LOCAL, 1234), "headers": []}
    await guard_app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _guard(monkeypatch: pytest.MonkeyPatch) -> tuple[AdminGuard, list[bytes]]:
    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("TIDAL_BIND_HOST", "127.0.0.1")
    seen: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return AdminGuard(inner), seen


def test_update_weights_with_a_bad_path_is_a_400_before_reaching_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    guard, seen = _guard(monkeypatch)
    body = json.dumps({"update_info": {"path": str(tmp_path / "missing")}}).encode()
    status, reply = asyncio.run(_call(guard, "/update_weights", body))
    assert status == 400 and b"does not exist" in reply and not seen
    status, reply = asyncio.run(_call(guard, "/update_weights", b'{"update_info": {}}'))
    assert status == 400 and b"path" in reply


def test_update_weights_with_a_complete_dir_passes_the_body_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    guard, seen = _guard(monkeypatch)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / ".complete").touch()
    body = json.dumps({"update_info": {"path": str(tmp_path)}}).encode()
    status, _ = asyncio.run(_call(guard, "/update_weights", body))
    assert status == 200 and seen == [body]

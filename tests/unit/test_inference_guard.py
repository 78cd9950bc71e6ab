"""Access policy of the inference server's middleware, and its pre-check of weight-update paths."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tidal.inference.guard import AccessPolicy, AdminGuard, chat_problem, update_info_problem
from tidal.transport.weight_checks import WEIGHTS_BROKEN

LOCAL, REMOTE = "127.0.0.1", "192.0.2.7"


def status(policy: AccessPolicy, path: str, client: str | None, token: str | None = None) -> int:
    denied = policy.check(path, client, token)
    return 200 if denied is None else denied[0]


DEV = ("/collective_rpc", "/sleep", "/wake_up", "/is_sleeping", "/server_info", "/weight_checker", "/docs")


def test_dev_and_other_routes_are_refused_unless_asked_for_even_from_loopback_with_the_token() -> None:
    """Issue 34: a default server without a token answered 200 to /collective_rpc (save_sharded_state wrote
    a file), /sleep and /wake_up from loopback: any local user could call them."""
    for token in (None, "s3cret"):
        policy = AccessPolicy(bind_host="127.0.0.1", admin_token=token)
        for path in (*DEV, "/collective_rpc/", "/something_new"):
            denied = policy.check(path, LOCAL, token)
            assert denied is not None and denied[0] == 403, (token, path)
            assert "inference.server.dev_routes" in denied[1]
        assert status(policy, "/v1/completions", LOCAL) == 200
        assert status(policy, "/pause", LOCAL, token) == 200


def test_loopback_bind_without_token_keeps_dev_routes_local() -> None:
    policy = AccessPolicy(bind_host="127.0.0.1", admin_token=None, dev_routes=True)
    assert status(policy, "/pause", LOCAL) == 200
    assert status(policy, "/collective_rpc", LOCAL) == 200
    assert status(policy, "/v1/completions", REMOTE) == 200
    assert status(policy, "/collective_rpc", REMOTE) == 403


def test_dev_and_unknown_routes_are_local_only_even_with_the_token() -> None:
    policy = AccessPolicy(bind_host="0.0.0.0", admin_token="s3cret", dev_routes=True)
    for path in ("/collective_rpc", "/collective_rpc/", "/sleep", "/server_info", "/docs", "/something_new"):
        assert status(policy, path, REMOTE, "s3cret") == 403, path
    assert status(policy, "/collective_rpc", None, "s3cret") == 403  # unknown client address: not local


def test_with_a_token_dev_routes_need_it_from_loopback_too() -> None:
    policy = AccessPolicy(bind_host="127.0.0.1", admin_token="s3cret", dev_routes=True)
    dev = (
        "/collective_rpc",
        "/sleep",
        "/wake_up",
        "/server_info",
        "/weight_checker",
        "/docs",
        "/something_new",
    )
    for path in dev:
        assert status(policy, path, LOCAL) == 401, path
        assert status(policy, path, LOCAL, "wrong") == 401, path
        assert status(policy, path, LOCAL, "s3cret") == 200, path
        assert status(policy, path, REMOTE, "s3cret") == 403, path
    assert status(policy, "/v1/completions", LOCAL) == 200
    assert status(policy, "/reset_prefix_cache", LOCAL) == 401


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

    scope = {"type": "http", "method": "POST", "path": path, "client": (LOCAL, 1234), "headers": []}
    await guard_app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _guard(
    monkeypatch: pytest.MonkeyPatch,
    reply: tuple[int, bytes] = (200, b"ok"),
    reference: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[AdminGuard, list[bytes]]:
    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("TIDAL_BIND_HOST", "127.0.0.1")
    for name in ("TIDAL_DEV_ROUTES", "TIDAL_NUM_WORKERS", "TIDAL_WEIGHTS_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    if reference is None:
        monkeypatch.delenv("TIDAL_REFERENCE_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("TIDAL_REFERENCE_WEIGHTS", str(reference))
    seen: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/update_weights":
            message = await receive()
            seen.append(message["body"])
            await send({"type": "http.response.start", "status": reply[0], "headers": []})
            await send({"type": "http.response.body", "body": reply[1]})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return AdminGuard(inner), seen


def checkpoint(directory: Path, **tensors: torch.Tensor) -> Path:
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    (directory / ".complete").touch()
    return directory


def update_body(directory: Path) -> bytes:
    return json.dumps({"update_info": {"path": str(directory)}}).encode()


def test_update_weights_with_a_bad_path_is_a_400_before_reaching_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    guard, seen = _guard(monkeypatch)
    body = json.dumps({"update_info": {"path": str(tmp_path / "missing")}}).encode()
    status, reply = asyncio.run(_call(guard, "/update_weights", body))
    assert status == 400 and b"does not exist" in reply and not seen
    status, reply = asyncio.run(_call(guard, "/update_weights", b'{"update_info": {}}'))
    assert status == 400 and b"path" in reply


def test_malformed_update_info_is_a_400_before_reaching_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 34: `{"update_info": []}` reached vLLM, which indexes the list by worker rank: a 500 ("list index
    out of range"). Each backend gets the shape checked; a list needs an object per worker."""
    good = {"path": str(checkpoint(tmp_path / "new", w=torch.ones(2, 3)))}
    for backend in ("filesystem", "nccl"):
        env = {"TIDAL_WEIGHTS_BACKEND": backend, "TIDAL_NUM_WORKERS": "2"}
        guard, seen = _guard(monkeypatch, env=env)
        cases = {
            b'{"update_info": []}': "empty list",
            b'{"update_info": "x"}': "must be an object",
            b'{"update_info": [{}, 3]}': "`update_info[1]` is not an object",
            json.dumps({"update_info": [good]}).encode(): "a list of 1 for this server's 2 workers",
            b"[]": "JSON object with an `update_info` field",
            b"{}": "JSON object with an `update_info` field",
            b"not json": "JSON object with an `update_info` field",
        }
        for body, expect in cases.items():
            status, reply = asyncio.run(_call(guard, "/update_weights", body))
            assert status == 400 and expect in json.loads(reply)["error"]["message"], (backend, body)
        assert not seen, backend
        for body in (json.dumps({"update_info": [good, good]}).encode(), update_body(Path(good["path"]))):
            assert asyncio.run(_call(guard, "/update_weights", body))[0] == 200, (backend, body)
        assert len(seen) == 2, backend
    assert update_info_problem(b'{"update_info": [{"path": "a"}]}', None) is None  # worker count unknown


def test_a_refused_update_leaves_vllms_session_open_so_the_finish_call_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.32's session as its workers keep it: an update that fails (an empty list: IndexError) closes
    the session, and the finish call after it fails too (both 500). The guard's 400 leaves it open."""
    monkeypatch.delenv("TIDAL_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("TIDAL_WEIGHTS_BACKEND", "nccl")
    monkeypatch.delenv("TIDAL_NUM_WORKERS", raising=False)
    active = False

    async def vllm(scope: Any, receive: Any, send: Any) -> None:
        nonlocal active
        chunks = [await receive()]
        while chunks[-1].get("more_body"):  # `_call` sends the body in two parts
            chunks.append(await receive())
        body = json.loads(b"".join(c.get("body", b"") for c in chunks) or b"{}")
        status = 200
        if scope["path"] == "/start_weight_update":
            active = True
        elif scope["path"] == "/update_weights":
            try:
                info = body["update_info"]
                _ = info[0] if isinstance(info, list) else info
            except IndexError:
                active, status = False, 500
        elif scope["path"] == "/finish_weight_update":
            status = 200 if active else 500
            active = False
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = AdminGuard(vllm)
    assert asyncio.run(_call(guard, "/start_weight_update", b""))[0] == 200
    assert asyncio.run(_call(guard, "/update_weights", b'{"update_info": []}'))[0] == 400
    assert asyncio.run(_call(guard, "/finish_weight_update", b""))[0] == 200
    assert asyncio.run(_call(vllm, "/start_weight_update", b""))[0] == 200  # without the guard
    assert asyncio.run(_call(vllm, "/update_weights", b'{"update_info": []}'))[0] == 500
    assert asyncio.run(_call(vllm, "/finish_weight_update", b""))[0] == 500


def test_dev_routes_reach_vllm_only_when_the_server_was_started_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = json.dumps({"method": "save_sharded_state", "kwargs": {"path": "/tmp/x"}}).encode()
    refused, _ = _guard(monkeypatch)
    status, reply = asyncio.run(_call(refused, "/collective_rpc", body))
    assert status == 403 and b"inference.server.dev_routes" in reply
    asked, _ = _guard(monkeypatch, env={"TIDAL_DEV_ROUTES": "1"})
    assert asyncio.run(_call(asked, "/collective_rpc", body)) == (200, b"ok")


def test_update_weights_with_a_complete_dir_passes_the_body_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    guard, seen = _guard(monkeypatch)
    body = update_body(checkpoint(tmp_path / "new", w=torch.ones(2, 3)))
    status, _ = asyncio.run(_call(guard, "/update_weights", body))
    assert status == 200 and seen == [body]


def test_bad_files_are_a_400_naming_the_tensor_before_reaching_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reference = checkpoint(tmp_path / "ref", w=torch.ones(2, 3), b=torch.ones(3))
    guard, seen = _guard(monkeypatch, reference=reference)
    cases = {
        "shape": (checkpoint(tmp_path / "shape", w=torch.ones(3, 2), b=torch.ones(3)), "tensor w has shape"),
        "missing": (checkpoint(tmp_path / "missing", w=torch.ones(2, 3)), "tensor b is missing"),
        "nan": (
            checkpoint(tmp_path / "nan", w=torch.ones(2, 3), b=torch.full((3,), float("nan"))),
            "tensor b",
        ),
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    (empty / ".complete").touch()
    cases["empty"] = (empty, "not a safetensors file")
    for label, (directory, expect) in cases.items():
        status, reply = asyncio.run(_call(guard, "/update_weights", update_body(directory)))
        assert status == 400 and expect in json.loads(reply)["error"]["message"], label
    assert not seen


def test_a_load_that_broke_the_weights_makes_the_server_unhealthy_until_an_update_succeeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    body = update_body(checkpoint(tmp_path / "new", w=torch.ones(2, 3)))
    restored, _ = _guard(monkeypatch, reply=(500, b"failed midway; the previous weights serve again"))
    assert asyncio.run(_call(restored, "/update_weights", body))[0] == 500
    assert asyncio.run(_call(restored, "/health", b""))[0] == 200  # the old weights are back: healthy
    broken, _ = _guard(monkeypatch, reply=(500, f"failed midway: {WEIGHTS_BROKEN}".encode()))
    assert asyncio.run(_call(broken, "/update_weights", body))[0] == 500
    assert asyncio.run(_call(broken, "/health", b""))[0] == 503
    status, reply = asyncio.run(_call(broken, "/v1/completions", b"{}"))
    assert status == 503 and WEIGHTS_BROKEN in reply.decode()
    broken.app = _guard(monkeypatch)[0].app  # the next update loads
    assert asyncio.run(_call(broken, "/update_weights", body))[0] == 200
    assert asyncio.run(_call(broken, "/health", b""))[0] == 200


def test_the_value_check_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIDAL_CHECK_FINITE", "0")
    guard, seen = _guard(monkeypatch)
    body = update_body(checkpoint(tmp_path / "nan", w=torch.full((2,), float("nan"))))
    assert asyncio.run(_call(guard, "/update_weights", body))[0] == 200 and seen == [body]


def test_chat_messages_with_an_unknown_role_are_refused_by_index() -> None:
    def body(*roles: Any) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": r, "content": "x"} for r in roles]}).encode()

    assert chat_problem(body("system", "user", "assistant", "tool")) is None
    assert chat_problem(body("user", "robot")) == (
        "messages[1].role: 'robot' is not one of system, user, assistant, tool"
    )
    assert chat_problem(body(None)) is not None and chat_problem(b'{"messages": [42]}') is not None
    assert chat_problem(b"not json") is None  # vLLM answers that one itself


def test_guard_answers_400_for_a_bad_role_and_passes_good_chats_with_their_body() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = AdminGuard(app)

    async def call(payload: dict[str, Any]) -> int:
        sent: list[Any] = []
        data = json.dumps(payload).encode()
        messages = [{"type": "http.request", "body": data, "more_body": False}]

        async def receive() -> Any:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "client": ("127.0.0.1", 1)}
        await guard(scope, receive, send)
        return int(sent[0]["status"])

    good = {"messages": [{"role": "user", "content": "hi"}]}
    assert asyncio.run(call(good)) == 200 and json.loads(seen[0]) == good
    assert asyncio.run(call({"messages": [{"role": "robot", "content": "hi"}]})) == 400 and len(seen) == 1


class SessionApp:
    """vLLM's RL routes as an ASGI app: the pause state and the update session, every call recorded; a
    second start while a session is open and a finish without one are 500s, as in vLLM."""

    def __init__(self, active: bool = False, fail: str | None = None):
        self.active, self.paused, self.version, self.fail = active, False, "0", fail
        self.calls: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        body = json.loads((await receive()).get("body") or b"{}")
        self.calls.append(path + ("?" + scope["query_string"].decode() if scope.get("query_string") else ""))
        status = 500 if path == self.fail else 200
        if status == 200 and path == "/start_weight_update":
            status = 500 if self.active else 200
            self.active = True
        elif status == 200 and path == "/finish_weight_update":
            status = 200 if self.active else 500
            self.active = False
            self.version = body.get("weight_version", self.version)
        elif status == 200 and path in ("/pause", "/resume"):
            self.paused = path == "/pause"
        message = json.dumps({"error": f"{path} failed"} if status >= 300 else {}).encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": message})


def load_body(directory: Path, version: int = 3, mode: str = "keep") -> bytes:
    body = {"update_info": {"path": str(directory)}, "weight_version": str(version), "pause_mode": mode}
    return json.dumps(body).encode()


FIVE = ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]


def test_the_load_route_runs_the_five_calls_in_the_server_and_times_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _guard(monkeypatch)  # the environment: no token, loopback
    app = SessionApp()
    good = checkpoint(tmp_path / "new", w=torch.ones(2, 3))
    status, reply = asyncio.run(_call(AdminGuard(app), "/tidal/load_weights", load_body(good)))
    assert status == 200 and app.calls == FIVE and app.version == "3" and not app.paused and not app.active
    seconds = json.loads(reply)["seconds"]
    assert set(seconds) == {"pause", "start", "update", "finish", "resume"}


def test_the_load_route_checks_the_update_like_a_direct_call_and_still_resumes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _guard(monkeypatch)
    app = SessionApp()
    status, reply = asyncio.run(
        _call(AdminGuard(app), "/tidal/load_weights", load_body(tmp_path / "missing"))
    )
    message = json.loads(reply)["error"]["message"]
    assert status == 400 and message.startswith("update: ") and "does not exist" in message
    # the refused body never reached vLLM; the session is closed without a version and generation resumes
    assert app.calls == [FIVE[0], FIVE[1], FIVE[3], FIVE[4]] and app.version == "0" and not app.paused
    assert not app.active


def test_the_load_route_closes_a_session_left_open_and_reports_a_failed_phase(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _guard(monkeypatch)
    good = checkpoint(tmp_path / "new", w=torch.ones(2, 3))
    left_open = SessionApp(active=True)
    assert asyncio.run(_call(AdminGuard(left_open), "/tidal/load_weights", load_body(good)))[0] == 200
    assert left_open.calls[:4] == [FIVE[0], FIVE[1], FIVE[3], FIVE[1]] and left_open.version == "3"
    broken_pause = SessionApp(fail="/pause")
    status, reply = asyncio.run(_call(AdminGuard(broken_pause), "/tidal/load_weights", load_body(good)))
    assert status == 500 and json.loads(reply)["error"]["message"] == "pause: /pause failed"
    assert broken_pause.calls == [FIVE[0]]  # not paused: nothing to resume
    broken_resume = SessionApp(fail="/resume")
    status, reply = asyncio.run(_call(AdminGuard(broken_resume), "/tidal/load_weights", load_body(good)))
    assert status == 500 and "resume: " in reply.decode() and broken_resume.version == "3"


def test_the_load_route_is_an_admin_route_and_refuses_a_malformed_body(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _guard(monkeypatch)
    app = SessionApp()
    good = checkpoint(tmp_path / "new", w=torch.ones(2, 3))
    for body, expect in (
        (b"[]", "body must be a JSON object"),
        (b'{"weight_version": "1"}', "`update_info` must be an object"),
        (json.dumps({"update_info": {"path": str(good)}}).encode(), "`weight_version` must be"),
        (load_body(good, mode="later"), "`pause_mode` must be one of keep, wait, abort"),
    ):
        code, reply = asyncio.run(_call(AdminGuard(app), "/tidal/load_weights", body))
        assert code == 400 and expect in json.loads(reply)["error"]["message"], body
    assert not app.calls
    policy = AccessPolicy(bind_host="0.0.0.0", admin_token="s3cret")
    assert status(policy, "/tidal/load_weights", LOCAL) == 401
    assert status(policy, "/tidal/load_weights", REMOTE, "s3cret") == 200

"""`POST /tidal/load_weights`: a whole weight update in one request, run inside the server.

vLLM's RL routes take five calls per update (pause, start, update, finish, resume), each a round trip from
the orchestrator. On one GPU the orchestrator's event loop is busy with hundreds of streaming requests, so
each of those awaits queues behind them: on an H100 the sequence took over ten times the load itself
(`benchmarks/results/loop_throughput_h100_round3.json`). Here the guard runs the same five calls
against vLLM's own app, back to back in the server's process, and answers once, with each phase's seconds.

Body: `{"update_info": {...}, "weight_version": "<n>", "pause_mode": "keep" | "wait" | "abort"}`. The
update's body goes through the guard's `/update_weights` checks like a direct call. The session handling is
the client's (`tidal.inference.fanout`): a start that fails closes a session left open and starts again; a
failed update closes the session without a version; resume runs whatever happened after the pause.
The answer is 200 with `{"weight_version", "seconds": {phase: s}}`, or the failing phase's own status with
`"<phase>: <vLLM's message>"`.
"""

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

ROUTE = "/tidal/load_weights"
PAUSE_MODES = ("keep", "wait", "abort")

Call = Callable[[str, str, bytes], Awaitable[tuple[int, bytes]]]
"""One internal POST: (path, query string, JSON body) → (status, body)."""


class PhaseFailed(Exception):
    """A phase answered an error status: the update stops there (after resuming)."""

    def __init__(self, phase: str, status: int, body: bytes):
        super().__init__(f"{phase}: {error_message(body)}")
        self.status = status


def error_message(body: bytes) -> str:
    """vLLM's error text from an answer body (an `{"error": ...}` object, FastAPI's `detail`, or text)."""
    try:
        found = json.loads(body or b"{}")
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(found, dict):
        error = found.get("error", found.get("detail", found))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:500]
    return str(found)[:500]


def parse_body(body: bytes) -> tuple[dict[str, Any], str, str] | str:
    """(update_info, weight version, pause mode) from the request, or why it is malformed."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return f"{ROUTE}: body must be a JSON object"
    info, version, mode = (
        parsed.get("update_info"),
        parsed.get("weight_version"),
        parsed.get("pause_mode", "keep"),
    )
    if not isinstance(info, dict | list):
        return f"{ROUTE}: `update_info` must be an object, or a list with an object per worker"
    if not isinstance(version, str | int) or isinstance(version, bool):
        return f"{ROUTE}: `weight_version` must be a string or an integer"
    if mode not in PAUSE_MODES:
        return f"{ROUTE}: `pause_mode` must be one of {', '.join(PAUSE_MODES)}, not {mode!r}"
    return {"update_info": info}, str(version), mode


SessionCall = Callable[[str, str, dict[str, Any] | None], Awaitable[None]]
"""One call of an update session: (phase name, route, JSON body or None); raises when the server refused."""


async def update_session(
    call: SessionCall, update: dict[str, Any], version: str, failures: tuple[type[BaseException], ...]
) -> None:
    """Start, update, finish as `version`, on a paused server; `failures`: what `call` raises for a refused
    call. This server's guard runs it (`load_weights`), and so does the client, over HTTP, for a server
    without the route (`tidal.inference.fanout`).

    A session left open (a client that died mid-update) makes the start fail: it is closed, and the start
    made again. A failed update closes the session without a version (nothing was loaded, or the workers
    restored the old weights), so the next update can start; the version stays the old one."""
    try:
        await call("start", "/start_weight_update", None)
    except failures:
        with contextlib.suppress(*failures):
            await call("finish", "/finish_weight_update", None)
        await call("start", "/start_weight_update", None)
    try:
        await call("update", "/update_weights", update)
    except BaseException:
        with contextlib.suppress(*failures):
            await call("finish", "/finish_weight_update", None)
        raise
    await call("finish", "/finish_weight_update", {"weight_version": version})


async def load_weights(call: Call, update: dict[str, Any], version: str, mode: str) -> dict[str, float]:
    """Pause, the update session (`update_session`), resume: each phase's seconds. Raises PhaseFailed for
    the first phase that failed (resume included), after resuming when the pause went through."""
    seconds: dict[str, float] = {}

    async def phase(name: str, path: str, body: dict[str, Any] | None, query: str = "") -> None:
        start = time.perf_counter()
        status, reply = await call(path, query, b"" if body is None else json.dumps(body).encode())
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        if status >= 300:
            raise PhaseFailed(name, status, reply)

    await phase("pause", "/pause", None, f"mode={mode}")
    try:
        await update_session(phase, update, version, (PhaseFailed,))
    finally:
        await phase("resume", "/resume", None)
    return seconds

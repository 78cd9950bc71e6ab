"""HTTP workers: generation requests sent, and their answers parsed, in processes beside the orchestrator.

At hundreds of servers and thousands of requests in flight, the HTTP exchange and the JSON of each answer
(aiohttp's protocol callbacks, vLLM's answer with a dict per sampled token) are most of the client's CPU;
on the orchestrator's one event loop they hold every other rollout, and the loop's lag grows with the
requests in flight. With `orchestrator.client.http_workers = K` the client keeps its routing, retries,
versions and weight updates, and hands each generation request to one of K worker processes (a server's
requests always to the same worker, which keeps its connections alive). A worker sends it with its own
aiohttp session, reads the answer and sends back only what the client reads (`slim_answer`): token ids,
logprobs, text, finish reason.

The parent and a worker talk over a socket pair: length-prefixed pickles, each holding every message one
loop iteration produced (a burst of answers costs one wake-up, not one each). A request whose caller is
cancelled is cancelled in the worker too. A worker that dies fails only the requests it held
(`HttpWorkerDied`: the client retries them, and does not blame the server) and is started again on next
use. Workers die with the orchestrator (parent-death signal; EOF on their socket).

The worker is `python -m tidal.inference.http_workers`: a fresh interpreter with only aiohttp imported (no
torch, no copy of the orchestrator's memory).
"""

import asyncio
import contextlib
import functools
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from typing import Any, Literal

import aiohttp

from tidal.process import exit_with_parent

Slim = Literal["completions", "chat"]
"""Which answer shape the worker reduces: `/v1/completions` or `/v1/chat/completions`."""

_HEADER = 4  # bytes of a frame's length
DELIVER_AT_ONCE = 1
"""Answers handed to their callers per loop iteration: a frame can hold hundreds, and the work each one
wakes (a group's scoring, the next request) would otherwise all run in one iteration, holding the loop."""
_EXIT_WAIT = 2.0
WORKER_NICENESS = 5
"""Workers yield the CPU to the orchestrator's loop when cores are short: the loop decides what runs next
(its lag delays every request), a worker only moves bytes, and its backlog waits in its socket."""


class HttpWorkerDied(RuntimeError):
    """The worker process carrying a request died: that request was not answered (retry it elsewhere)."""


# ---- what a worker sends back (pure) ---------------------------------------------------------------------


def slim_answer(data: dict[str, Any], shape: Slim) -> dict[str, Any]:
    """The parts of a vLLM completion answer that `InferenceClient` reads, in the same layout (a valid
    answer of that route, only smaller): the prompt's token ids once, and per choice its index, token ids,
    text, finish reason, sampled-token logprobs and routed experts (when there)."""
    if shape == "completions":
        choices = [
            {
                "index": c["index"],
                "token_ids": c["token_ids"],
                "text": c.get("text"),
                "finish_reason": c.get("finish_reason"),
                "logprobs": {"token_logprobs": c["logprobs"]["token_logprobs"]},
                **_routes(c),
            }
            for c in data["choices"]
        ]
        if choices:
            choices[0]["prompt_token_ids"] = data["choices"][0]["prompt_token_ids"]
        return {"choices": choices}
    return {
        "prompt_token_ids": data["prompt_token_ids"],
        "choices": [
            {
                "index": c["index"],
                "token_ids": c["token_ids"],
                "finish_reason": c.get("finish_reason"),
                "message": {"content": c["message"]["content"]},
                "logprobs": {"content": [{"logprob": t["logprob"]} for t in c["logprobs"]["content"]]},
                **_routes(c),
            }
            for c in data["choices"]
        ],
    }


def _routes(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice's routed experts (routing replay), where the server returned them."""
    routes = choice.get("routed_experts")
    return {} if routes is None else {"routed_experts": routes}


# ---- framing over a stream socket ------------------------------------------------------------------------


class _Outbox:
    """Messages queued in one loop iteration, written as one frame at its end."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self._queued: list[Any] = []

    def put(self, message: Any) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(message)

    def _flush(self) -> None:
        if self.writer.is_closing():
            self._queued = []
            return
        payload = pickle.dumps(self._queued, protocol=pickle.HIGHEST_PROTOCOL)
        self._queued = []
        self.writer.write(len(payload).to_bytes(_HEADER, "big") + payload)


async def _read_frame(reader: asyncio.StreamReader) -> list[Any]:
    """The next frame's messages; raises IncompleteReadError at EOF."""
    size = int.from_bytes(await reader.readexactly(_HEADER), "big")
    messages: list[Any] = pickle.loads(await reader.readexactly(size))
    return messages


# ---- the parent's side -----------------------------------------------------------------------------------


class HttpWorkers:
    """`num_workers` worker processes, started on first use; `await post(key, url, body, shape)`."""

    def __init__(self, num_workers: int, connect_timeout: float, read_timeout: float):
        if num_workers < 1:
            raise ValueError("HttpWorkers needs at least one worker")
        self.timeouts = (connect_timeout, read_timeout)
        self._workers: list[_Worker | None] = [None] * num_workers
        self._starting: list[asyncio.Lock] = [asyncio.Lock() for _ in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None and w.alive]

    async def post(self, key: int, url: str, body: dict[str, Any], shape: Slim) -> tuple[int, bytes, Any]:
        """POST `body` as JSON to `url` from worker `key % num_workers`: (status, body, slim answer). A
        200 answer comes parsed and slimmed (body empty), anything else as its raw body (answer None).
        Raises TimeoutError, aiohttp.ClientConnectionError (the server is unreachable) or HttpWorkerDied."""
        worker = await self._worker(key % self.num_workers)
        return await worker.post(url, body, shape)

    async def close(self) -> None:
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self.num_workers
        await asyncio.gather(*(w.close() for w in workers))

    async def _worker(self, index: int) -> "_Worker":
        worker = self._workers[index]
        if worker is not None and worker.alive:
            return worker
        async with self._starting[index]:  # one start per slot, however many requests wait for it
            worker = self._workers[index]
            if worker is None or not worker.alive:
                if worker is not None:
                    await worker.close()
                worker = await _Worker.start(*self.timeouts)
                self._workers[index] = worker
            return worker


class _Worker:
    """One worker process, the parent's end of its socket and the requests it carries."""

    def __init__(
        self, process: subprocess.Popen[bytes], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ):
        self.process = process
        self.writer = writer
        self.outbox = _Outbox(writer)
        self.pending: dict[int, asyncio.Future[tuple[int, bytes, Any]]] = {}
        self.alive = True
        self._next_id = 0
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    @staticmethod
    async def start(connect_timeout: float, read_timeout: float) -> "_Worker":
        ours, theirs = socket.socketpair()
        try:
            argv = [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())]
            process = subprocess.Popen(
                [*argv, str(connect_timeout), str(read_timeout)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        return _Worker(process, reader, writer)

    async def post(self, url: str, body: dict[str, Any], shape: Slim) -> tuple[int, bytes, Any]:
        if not self.alive:
            raise HttpWorkerDied("the HTTP worker is gone")
        self._next_id += 1
        request_id = self._next_id
        answer: asyncio.Future[tuple[int, bytes, Any]] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = answer
        self.outbox.put(("post", request_id, url, body, shape))
        try:
            return await answer
        except asyncio.CancelledError:
            if self.pending.pop(request_id, None) is not None and self.alive:
                self.outbox.put(("cancel", request_id))
            raise

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                replies = await _read_frame(reader)
                for start in range(0, len(replies), DELIVER_AT_ONCE):
                    if start:
                        # the callers woken so far run (and the loop's timers fire) before the next ones
                        await asyncio.sleep(0)
                    self._deliver(replies[start : start + DELIVER_AT_ONCE])
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._fail_pending()

    def _deliver(self, replies: list[Any]) -> None:
        for request_id, kind, value in replies:
            answer = self.pending.pop(request_id, None)
            if answer is None or answer.done():
                continue  # cancelled meanwhile
            if kind == "ok":
                answer.set_result(value)
            elif kind == "timeout":
                answer.set_exception(TimeoutError(value))
            else:
                answer.set_exception(aiohttp.ClientConnectionError(value))

    def _fail_pending(self) -> None:
        self.alive = False
        code = self.process.poll()
        how = "still running" if code is None else f"exit code {code}" if code >= 0 else f"signal {-code}"
        for answer in self.pending.values():
            if not answer.done():
                answer.set_exception(HttpWorkerDied(f"HTTP worker {self.process.pid} died ({how})"))
        self.pending.clear()

    async def close(self) -> None:
        """EOF to the worker (it cancels what it carries and exits); SIGKILL if it has not after a while."""
        self.alive = False
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), _EXIT_WAIT)
        except TimeoutError:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


# ---- the worker process ----------------------------------------------------------------------------------


async def serve(sock: socket.socket, connect_timeout: float, read_timeout: float) -> None:
    """Answer the parent's requests until it closes the socket."""
    reader, writer = await asyncio.open_connection(sock=sock)
    outbox = _Outbox(writer)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)  # as the client's own
    timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout, sock_read=read_timeout)
    running: dict[int, asyncio.Task[None]] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        try:
            while True:
                for message in await _read_frame(reader):
                    if message[0] == "post":
                        _, request_id, url, body, shape = message
                        task = asyncio.create_task(_exchange(session, outbox, request_id, url, body, shape))
                        running[request_id] = task
                        task.add_done_callback(functools.partial(_forget, running, request_id))
                    else:  # ("cancel", id): its caller gave up
                        cancelled = running.pop(message[1], None)
                        if cancelled is not None:
                            cancelled.cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the parent is gone or closed us
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)


def _forget(running: dict[int, "asyncio.Task[None]"], request_id: int, _: object) -> None:
    running.pop(request_id, None)


async def _exchange(
    session: aiohttp.ClientSession, outbox: _Outbox, request_id: int, url: str, body: Any, shape: Slim
) -> None:
    data = json.dumps(body, separators=(",", ":"))
    try:
        async with session.post(url, data=data, headers={"content-type": "application/json"}) as response:
            status, raw = response.status, await response.read()
    except TimeoutError as exc:
        outbox.put((request_id, "timeout", f"{url} timed out ({type(exc).__name__})"))
        return
    except (aiohttp.ClientError, OSError) as exc:
        outbox.put((request_id, "unreachable", f"{type(exc).__name__}: {exc}"))
        return
    if status == 200:
        try:
            outbox.put((request_id, "ok", (status, b"", slim_answer(json.loads(raw), shape))))
            return
        except (ValueError, KeyError, TypeError, IndexError):
            pass  # not the answer we know: the client reports it from the raw body
    outbox.put((request_id, "ok", (status, raw, None)))


def main(argv: list[str]) -> None:
    fd, parent_pid, connect_timeout, read_timeout = int(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    sock = socket.socket(fileno=fd)
    asyncio.run(serve(sock, connect_timeout, read_timeout))


if __name__ == "__main__":
    main(sys.argv[1:])

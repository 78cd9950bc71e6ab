"""HTTP worker processes of the inference client, against real local HTTP servers: what they send back is
what the client reads, and a dead worker, a cancelled request or a dead orchestrator leave nothing behind."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.unit.http_servers import Seen, client_over, make_client, reply
from tidal.inference.http_workers import HttpWorkers, slim_answer
from tidal.inference.types import ChatMessage, ChatRequest, GenerateRequest, SamplingParams

SAMPLING = SamplingParams(max_tokens=3, temperature=1.0)


def full_completion_answer() -> dict:
    """A `/v1/completions` answer as vLLM gives it with logprobs=0 and return_token_ids (two choices, listed
    out of order)."""

    def choice(index: int, ids: list[int]) -> dict:
        return {
            "index": index,
            "text": f"t{index}",
            "token_ids": ids,
            "prompt_token_ids": [1, 2, 3],
            "finish_reason": "length" if index else "stop",
            "stop_reason": None,
            "logprobs": {
                "tokens": [f"x{i}" for i in ids],
                "token_logprobs": [-0.25 * (i + 1) for i in range(len(ids))],
                "top_logprobs": [{f"x{i}": -0.25} for i in ids],
                "text_offset": list(range(len(ids))),
            },
        }

    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice(1, [5, 6, 7]), choice(0, [8])]}


def full_chat_answer() -> dict:
    return {
        "id": "chat-1",
        "prompt_token_ids": [4, 5],
        "choices": [
            {
                "index": 0,
                "token_ids": [9, 10],
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
                "logprobs": {
                    "content": [
                        {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []},
                        {"token": "i", "logprob": -1.0, "bytes": [105], "top_logprobs": []},
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    }


def test_through_workers_the_client_reads_the_same_generations_from_slimmer_answers() -> None:
    def handler(request: Seen) -> web.Response:
        return reply(
            200, full_chat_answer() if request.path.endswith("chat/completions") else full_completion_answer()
        )

    async def both(http_workers: int) -> tuple:
        async with client_over(handler, ("a",), http_workers=http_workers) as (client, _):
            generated = await client.generation.generate(
                GenerateRequest(prompt_token_ids=(1, 2, 3), sampling=SAMPLING)
            )
            chatted = await client.generation.chat(
                ChatRequest(messages=(ChatMessage(role="user", content="hey"),), sampling=SAMPLING)
            )
        return generated.model_copy(update={"server": ""}), chatted.model_copy(update={"server": ""})

    on_loop, in_workers = asyncio.run(both(0)), asyncio.run(both(1))
    assert in_workers == on_loop
    assert [c.token_ids for c in on_loop[0].completions] == [(8,), (5, 6, 7)]  # by index
    assert on_loop[1].completions[0].logprobs == (-0.5, -1.0)
    slim = slim_answer(full_completion_answer(), "completions")
    assert "top_logprobs" not in str(slim) and len(str(slim)) < len(str(full_completion_answer())) / 2


async def healthy(request: web.Request) -> web.Response:
    return web.Response()


async def slow_server(seen: asyncio.Event, hung_up: asyncio.Event, release: asyncio.Event) -> TestServer:
    """Holds each completion until `release`, setting `hung_up` if the client closes the connection first."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.set()
        try:
            while not release.is_set():
                if request.transport is None or request.transport.is_closing():
                    hung_up.set()
                    break
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:  # aiohttp versions that cancel the handler when the client hangs up
            hung_up.set()
            raise
        return web.json_response(full_completion_answer())

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_get("/health", healthy)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def test_a_killed_worker_fails_only_its_requests_which_are_retried_and_the_server_stays_in() -> None:
    async def go() -> None:
        seen, hung_up, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
        server = await slow_server(seen, hung_up, release)
        url = str(server.make_url("")).rstrip("/")
        try:
            async with make_client([url], model="m", backoff=0.0, http_workers=1) as client:
                request = GenerateRequest(prompt_token_ids=(1,), sampling=SAMPLING)
                pending = asyncio.create_task(client.generation.generate(request))
                await asyncio.wait_for(seen.wait(), 10)
                [first] = client.generation.workers.pids()  # type: ignore[union-attr]
                os.kill(first, signal.SIGKILL)
                await asyncio.wait_for(hung_up.wait(), 10)  # its connection died with it
                release.set()
                generation = await asyncio.wait_for(pending, 20)  # sent again, from a new worker
                assert [c.token_ids for c in generation.completions] == [(8,), (5, 6, 7)]
                assert client.pool.servers[url].healthy and client.generation.workers.pids() != [first]  # type: ignore[union-attr]
        finally:
            await server.close()

    asyncio.run(go())


def test_a_cancelled_request_hangs_up_in_the_worker_and_close_reaps_every_worker() -> None:
    async def go() -> list[int]:
        seen, hung_up, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
        server = await slow_server(seen, hung_up, release)
        url = str(server.make_url("")).rstrip("/") + "/v1/completions"
        workers = HttpWorkers(2, connect_timeout=5.0, read_timeout=60.0)
        try:
            waiting = asyncio.create_task(workers.post(0, url, {"prompt": [1]}, "completions"))
            await asyncio.wait_for(seen.wait(), 10)
            waiting.cancel()
            await asyncio.wait_for(hung_up.wait(), 10)  # the worker dropped the server's connection
            status, _, answer = await workers.post(
                1, url.replace("completions", "nothing"), {}, "completions"
            )
            assert status == 404 and answer is None  # not an answer to slim: passed on raw
            pids = workers.pids()
            assert len(pids) == 2
        finally:
            await workers.close()
            await server.close()
        return pids

    for pid in asyncio.run(go()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"HTTP worker {pid} outlived close()")


def test_workers_die_with_a_sigkilled_orchestrator() -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from tidal.inference.http_workers import HttpWorkers

        async def main():
            workers = HttpWorkers(2, 5.0, 5.0)
            for key in range(2):
                await workers._worker(key)
            print(*workers.pids(), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.05)
    assert not alive, f"HTTP workers {alive} outlived the process that started them"


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie — dead, its parent gone before reaping it — does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

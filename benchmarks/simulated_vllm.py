"""Simulated OpenAI-compatible inference servers for client benchmarks: many ports per process, no model.

Benchmark-only stand-ins for GPUs (never used by the product or its tests of real inference). One process
listens on `--ports` local ports (chosen by the OS, printed as one JSON line on stdout) and answers, after
`--latency` seconds (a timer, so waiting costs no CPU):

- `POST /v1/completions`: vLLM's response shape for a token-id prompt with `logprobs: 0` and
  `return_token_ids: true`: `n` choices of `max_tokens` tokens, each with `token_ids`, `prompt_token_ids`,
  `text`, `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), `finish_reason`, `index`;
- `GET /v1/models`, `GET /health`, `GET /weight_info`.

Completions are drawn from `--vocab` (a JSON object text → token id) so text and ids agree. The HTTP/1.1
server is a small asyncio protocol with keep-alive (answers are pre-serialised fragments) so the servers
cost the shared cores little. The process exits when its stdin closes, so it never outlives its parent.

    python benchmarks/simulated_vllm.py --ports 64 --latency 0.05 --vocab '{"a": 70, "b": 71}'
"""

import argparse
import asyncio
import json
import random
import socket
import sys
from collections.abc import Callable

MODEL = "simulated"
POOL = 64
"""Distinct pre-serialised completions per (length, index); requests cycle through them."""


def completion_fragments(vocab: dict[str, int], max_tokens: int, index: int, rng: random.Random) -> bytes:
    """One choice of a vLLM completion without its closing brace and prompt ids (pure)."""
    chars = rng.choices(sorted(vocab), k=max_tokens)
    logprobs = [round(-rng.random() * 3, 6) for _ in chars]
    offsets, pos = [], 0
    for c in chars:
        offsets.append(pos)
        pos += len(c)
    choice = {
        "index": index,
        "text": "".join(chars),
        "token_ids": [vocab[c] for c in chars],
        "logprobs": {
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": chars,
            "top_logprobs": [{c: lp} for c, lp in zip(chars, logprobs, strict=True)],
        },
        "finish_reason": "length",
        "stop_reason": None,
    }
    return json.dumps(choice)[:-1].encode() + b', "prompt_token_ids": '


class Completions:
    """Builds `/v1/completions` bodies from cached fragments: only the prompt echo is serialised per request."""

    def __init__(self, vocab: dict[str, int], seed: int):
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.cache: dict[tuple[int, int], list[bytes]] = {}
        self.count = 0

    def body(self, request: dict[str, object]) -> bytes:
        n, max_tokens = int(request.get("n", 1)), int(request.get("max_tokens", 16))  # type: ignore[call-overload]
        prompt = json.dumps(request.get("prompt", [])).encode()
        self.count += 1
        choices = []
        for i in range(n):
            pool = self.cache.get((max_tokens, i))
            if pool is None:
                pool = [completion_fragments(self.vocab, max_tokens, i, self.rng) for _ in range(POOL)]
                self.cache[(max_tokens, i)] = pool
            choices.append(pool[(self.count + i) % POOL] + prompt + b"}")
        usage = b'{"prompt_tokens": %d, "completion_tokens": %d}' % (prompt.count(b",") + 1, n * max_tokens)
        return (
            b'{"id": "cmpl-%d", "object": "text_completion", "model": "%s", "choices": [%s], "usage": %s}'
            % (self.count, MODEL.encode(), b", ".join(choices), usage)
        )


def response(status: int, body: bytes) -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}.get(status, b"Error")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        status,
        reason,
        len(body),
    )
    return head + body


MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
WEIGHT_INFO = json.dumps({"weight_version": "default"}).encode()


class Http(asyncio.Protocol):
    """Keep-alive HTTP/1.1, one request at a time per connection (what HTTP clients without pipelining send)."""

    def __init__(self, completions: Completions, latency: Callable[[], float]):
        self.completions = completions
        self.latency = latency
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = head.split(" ", 2)[:2]
            self.answer(method, path.split("?", 1)[0], body)

    def answer(self, method: str, path: str, body: bytes) -> None:
        if path == "/v1/completions" and method == "POST":
            out = response(200, self.completions.body(json.loads(body)))
            asyncio.get_running_loop().call_later(self.latency(), self.send, out)
        elif path == "/health":
            self.send(response(200, b""))
        elif path == "/v1/models":
            self.send(response(200, MODELS))
        elif path == "/weight_info":
            self.send(response(200, WEIGHT_INFO))
        else:
            self.send(response(404, b'{"error": {"message": "no such route"}}'))

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(num_ports: int, latency: float, jitter: float, vocab: dict[str, int], seed: int) -> None:
    loop = asyncio.get_running_loop()
    completions = Completions(vocab, seed)
    rng = random.Random(seed)

    def delay() -> float:
        return latency * (1 + jitter * (2 * rng.random() - 1))

    ports = []
    for _ in range(num_ports):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        ports.append(sock.getsockname()[1])
        await loop.create_server(lambda: Http(completions, delay), sock=sock, backlog=4096)
    print(json.dumps({"ports": ports}), flush=True)
    closed = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), lambda: closed.set() if not sys.stdin.buffer.read1(1) else None)
    await closed.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, required=True, help="servers (ports) in this process")
    parser.add_argument("--latency", type=float, default=0.05, help="seconds before each completion answer")
    parser.add_argument("--jitter", type=float, default=0.0, help="latency varies uniformly by ± this share")
    parser.add_argument("--vocab", required=True, help="JSON object: completion text piece -> token id")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = serve(args.ports, args.latency, args.jitter, json.loads(args.vocab), args.seed)
    try:
        import uvloop  # the stand-ins should cost the shared cores as little as possible
    except ImportError:
        asyncio.run(work)
    else:
        uvloop.run(work)


if __name__ == "__main__":
    main()

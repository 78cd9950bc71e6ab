"""Prefill/decode disaggregation against two ordinary replicas on two GPUs: generation throughput and
time to first token for long prompts (default 8192 prompt tokens, 512 new tokens).

Each mode starts two vLLM servers through tidal (one per GPU): `replicas` two ordinary ones behind the
client's least-loaded routing, `disaggregated` a prefill server on the first GPU and a decode server on the
second joined by a KV connector (NixlConnector when the `nixl` package imports, else ExampleConnector with
its store in /dev/shm). Per mode, two passes over the same distinct random prompts (no shared prefixes):
- throughput: every request through `InferenceClient.generate` (what `tidal rl` and `tidal eval` send),
  `--concurrency` at a time; completion tokens / wall seconds;
- time to first token: the same requests streamed (the disaggregated ones prefilled first, as the client
  does it), from sending to the first streamed token, at the same concurrency.

    python benchmarks/disagg_serving.py --out benchmarks/results/disagg_serving_h200x2.json
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tidal.config.inference import InferenceConfig
from tidal.config.rl import ClientConfig
from tidal.inference.client import InferenceClient
from tidal.inference.disagg import Prefill, decode_body, empty_store, prefill_body, with_roles
from tidal.inference.server import ServerProcess, build_launch
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.testing import RANDOM_QWEN3_0_6B, resolve_model_name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=RANDOM_QWEN3_0_6B, help="HF path or tidal-testing name")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--connector", default=None, help="default: NixlConnector if nixl imports, else ExampleConnector"
    )
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--modes", nargs="+", default=["replicas", "disaggregated"])
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def default_connector() -> str:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return "ExampleConnector"
    return "NixlConnector"


def server_configs(args: argparse.Namespace, mode: str, store: Path) -> list[InferenceConfig]:
    base: dict[str, Any] = {
        "model": {"name": args.model, "dtype": "bfloat16"},
        "vllm": {
            "max_model_len": args.prompt_tokens + args.new_tokens + 64,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
    }
    if mode == "disaggregated":
        base["disaggregation"] = {"connector": args.connector}
    configs = []
    for index in range(2):
        server = {"port": args.port + index, "log_file": str(args.out.parent / f"disagg_{mode}_{index}.log")}
        configs.append(InferenceConfig.model_validate({**base, "server": server}))
    return with_roles(configs, store)


def start(configs: list[InferenceConfig], gpus: list[str]) -> list[ServerProcess]:
    model_path = resolve_model_name(configs[0].model.name)
    servers = []
    for config, gpu in zip(configs, gpus, strict=True):
        launch = build_launch(config, model_path, "cuda")
        launch.env["CUDA_VISIBLE_DEVICES"] = gpu
        servers.append(ServerProcess(launch).start())
    for server in servers:
        server.wait_ready(900)
    return servers


def prompts(args: argparse.Namespace) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(resolve_model_name(args.model)).vocab_size
    rng = random.Random(0)
    return [
        [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]


async def throughput(
    client: InferenceClient, batch: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    gate = asyncio.Semaphore(args.concurrency)
    sampling = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=1)

    async def one(prompt: list[int]) -> int:
        async with gate:
            generation = await client.generation.generate(
                GenerateRequest(prompt_token_ids=tuple(prompt), sampling=sampling)
            )
        return len(generation.completions[0].token_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in batch)))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "completion_tokens": tokens, "tokens_per_s": tokens / seconds}


async def first_tokens(
    urls: list[str], prefill_url: str | None, model: str, batch: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """Streamed requests, round robin over `urls`; with `prefill_url`, each prefilled there first."""
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def one(session: aiohttp.ClientSession, index: int, prompt: list[int]) -> float:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.new_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with gate:
            start = time.perf_counter()
            if prefill_url is not None:
                async with session.post(f"{prefill_url}/v1/completions", json=prefill_body(body)) as answer:
                    params = (await answer.json()).get("kv_transfer_params")
                body = decode_body(body, Prefill(prefill_url, 0, params), 0)
            async with session.post(f"{urls[index % len(urls)]}/v1/completions", json=body) as answer:
                async for line in answer.content:
                    if line.startswith(b"data: ") and b'"text"' in line:
                        first = time.perf_counter() - start
                        break
                else:
                    raise RuntimeError(f"no token streamed back (status {answer.status})")
                async for _ in answer.content:  # the rest of the stream: the servers stay as loaded
                    pass
        return first

    async with aiohttp.ClientSession(timeout=timeout) as session:
        seconds = await asyncio.gather(*(one(session, i, p) for i, p in enumerate(batch)))
    ordered = sorted(seconds)
    return {
        "mean_s": statistics.fmean(seconds),
        "p50_s": ordered[len(ordered) // 2],
        "p90_s": ordered[int(len(ordered) * 0.9)],
    }


async def measure(
    servers: list[ServerProcess], mode: str, store: Path, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    urls = [s.url for s in servers]
    prefill = urls[:1] if mode == "disaggregated" else []
    decode = urls[1:] if mode == "disaggregated" else urls
    batch = prompts(args)
    warm = [[5] * args.prompt_tokens]
    config = ClientConfig(urls=decode, prefill_urls=prefill, kv_store=str(store), timeout=3600)
    async with InferenceClient.from_config(config, model=model) as client:
        await throughput(client, warm, args)  # CUDA graphs, allocator, connector handshakes
        result: dict[str, Any] = {"throughput": await throughput(client, batch, args)}
    empty_store(store)
    shifted = [[t + 1 for t in p] for p in batch]  # not the throughput pass's: no prefix cache hit anywhere
    result["time_to_first_token"] = await first_tokens(
        decode, prefill[0] if prefill else None, model, shifted, args
    )
    empty_store(store)
    return result


def main() -> int:
    args = parse_args()
    args.connector = args.connector or default_connector()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store = Path("/dev/shm/tidal_kv_store")
    store.mkdir(exist_ok=True)
    gpus = args.gpus.split(",")
    results: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "connector": args.connector,
        "modes": {},
    }
    for mode in args.modes:
        servers = start(server_configs(args, mode, store), gpus)
        try:
            results["modes"][mode] = asyncio.run(measure(servers, mode, store, args.model, args))
        finally:
            for server in servers:
                server.stop()
            empty_store(store)
        print(mode, json.dumps(results["modes"][mode]), flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

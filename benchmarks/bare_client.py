"""The bare baseline for benchmarks/orchestrator_scale.py: aiohttp at a fixed number of requests in flight.

A lean process of its own (aiohttp and the lag monitor only; no torch, no tidal client), so its rate is what
a bare async HTTP client reaches on this machine against the same simulated servers: `concurrency` workers
post the given request bodies round-robin over the servers through one keep-alive pool and parse each JSON
answer. It reads a spec (JSON file) and prints one JSON line: the same window measurements as the tidal side.

    python benchmarks/bare_client.py SPEC.json
"""

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tidal.orchestrator.lag import LoopLagMonitor, lag_metrics  # noqa: E402


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes (Linux /proc)."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


async def run(spec: dict) -> dict:
    bodies = [b.encode() for b in spec["bodies"]]
    targets = itertools.cycle(u + "/v1/completions" for u in spec["urls"])
    done = [0]
    headers = {"content-type": "application/json"}

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        body = bodies[i % len(bodies)]
        while True:
            async with session.post(next(targets), data=body, headers=headers) as response:
                data = await response.json()
            if not data["choices"]:
                raise RuntimeError("empty answer")
            done[0] += 1

    def mark() -> dict:
        return {
            "t": time.perf_counter(),
            "cpu": time.process_time(),
            "servers_cpu": cpu_seconds(spec["server_pids"]),
            "requests": done[0],
        }

    lag = LoopLagMonitor()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        lag.start()
        workers = [asyncio.create_task(worker(session, i)) for i in range(spec["concurrency"])]
        await asyncio.sleep(spec["warmup"])
        lag.take()
        start = mark()
        await asyncio.sleep(spec["seconds"])
        end = mark()
        lags = lag.take()
        failed = [w for w in workers if w.done()]
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await lag.stop()
    if failed:
        raise RuntimeError(f"{len(failed)} bare workers stopped: {failed[0].exception()!r}")
    seconds = end["t"] - start["t"]
    requests = end["requests"] - start["requests"]
    summary = lag_metrics(lags)
    return {
        "window_s": seconds,
        "requests": requests,
        "requests_per_s": requests / seconds,
        "rollouts_per_s": requests / seconds * spec["rollouts_per_request"],
        "client_cpu_s_per_request": (end["cpu"] - start["cpu"]) / max(requests, 1),
        "client_cpu_share": (end["cpu"] - start["cpu"]) / seconds,
        "servers_cpu_share": (end["servers_cpu"] - start["servers_cpu"]) / seconds,
        "lag_p50_s": summary["event_loop/lag_p50_s"],
        "lag_p99_s": summary["event_loop/lag_p99_s"],
        "lag_max_s": summary["event_loop/lag_max_s"],
        "lag_samples": len(lags),
        "requests_in_flight": spec["concurrency"],
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(asyncio.run(run(spec))), flush=True)


if __name__ == "__main__":
    main()

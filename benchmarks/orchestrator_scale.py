"""Can the orchestrator's inference client keep up at cluster scale? The real client against N simulated servers.

What runs: `benchmarks/simulated_vllm.py` processes (`--server-procs` of them, each listening on many
ports) stand in for N vLLM servers: they answer `/v1/completions` after `--latency` seconds with vLLM's
response shape (token ids, logprobs). Against them, in this one process, each cell of the grid measures:

- tidal: the real `Orchestrator._collect` (task stream, `run_group`, environment rollout and reward,
  acceptance and advantages) over the real `InferenceClient` (health watch running) and the tiny local
  tokenizer from `tidal.testing`, for one long step (`max_async_level` large: no policy waits; the trainer
  and batch shipping are not part of this benchmark). `rollouts_in_flight` / `group_size` groups run at
  once. Single-turn is reverse_text (one n-sample request per group of `group_size`); 4-turn is a
  benchmark-only `MultiTurnEnv` (below: four model turns, one request each, every rollout its own session).
- bare: `benchmarks/bare_client.py`, aiohttp (keep-alive pool) in a lean process of its own, posting the
  same request bodies round-robin to the same servers at the same number of requests in flight and parsing
  each JSON answer: the request rate this machine allows.

Each cell warms up, then measures over a window: rollouts/s (scored rollouts of finished groups),
requests/s, client CPU seconds per rollout (this process's CPU time over the window / rollouts), and the
event-loop lag p50/p99/max (`LoopLagMonitor`). The reward variant `heavy` adds a CPU-bound reward.

    python benchmarks/orchestrator_scale.py --out benchmarks/results/orchestrator_scale_cpu.json
    python benchmarks/orchestrator_scale.py --quick --out /tmp/scale.json          # the deciding cell only
    python benchmarks/orchestrator_scale.py --profile /tmp/scale.prof --quick        # cProfile that cell
"""

import argparse
import asyncio
import cProfile
import gc
import itertools
import json
import math
import os
import platform
import pstats
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from bare_client import cpu_seconds  # noqa: E402

from tidal.envs.base import Episode, RewardFn, Task  # noqa: E402
from tidal.envs.multiturn import MultiTurnEnv  # noqa: E402
from tidal.envs.reverse_text import ReverseTextEnv, reversal_accuracy  # noqa: E402
from tidal.orchestrator.lag import LoopLagMonitor, frozen_heap, lag_metrics  # noqa: E402

SERVERS = (16, 64, 256)
IN_FLIGHT = (1024, 4096, 16384)
TURNS = (1, 4)
REWARDS = ("light", "heavy")
DECIDING = {"servers": 256, "rollouts_in_flight": 4096, "turns": 1, "reward": "light"}
TARGET_ROLLOUTS_PER_S = 5000.0
TARGET_BARE_SHARE = 0.8
TARGET_LAG_P99_S = 0.050
POOL_WARMUP_S = 4.0
"""Extra warm-up where rewards run in worker processes: they are spawned (and import tidal) at the start."""

# ---- pure logic ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    servers: int
    rollouts_in_flight: int
    turns: int
    reward: str

    def requests_in_flight(self, group_size: int) -> int:
        """Single-turn: one n-sample request per group; multi-turn: one request per rollout at a time."""
        return self.rollouts_in_flight // group_size if self.turns == 1 else self.rollouts_in_flight

    def key(self) -> dict[str, Any]:
        return asdict(self)


def timing(cell: Cell, args: argparse.Namespace) -> tuple[float, float]:
    """Warm-up and window of a cell: a multi-turn episode lasts at least `turns` latencies, so its cells get
    two episodes more of warm-up and a window of at least three episodes (rollouts finish in whole groups)."""
    episode = cell.turns * args.latency
    if cell.turns == 1:
        return args.warmup, args.seconds
    return args.warmup + 2 * episode, max(args.seconds, 3 * episode)


def grid(quick: bool) -> list[Cell]:
    """Every cell, or with `quick` the deciding cell and its 4-turn and heavy-reward neighbours."""
    if quick:
        d = DECIDING
        return [
            Cell(d["servers"], d["rollouts_in_flight"], 1, "light"),
            Cell(d["servers"], d["rollouts_in_flight"], 4, "light"),
            Cell(d["servers"], d["rollouts_in_flight"], 1, "heavy"),
        ]
    return [Cell(*c) for c in itertools.product(SERVERS, IN_FLIGHT, TURNS, REWARDS)]


def verdict(cell_result: dict[str, Any]) -> dict[str, Any]:
    """The issue's criterion on one cell: lag p99 under 50 ms, and rollouts/s ≥ the lower of 5,000/s and
    80% of the bare request rate (requests at equal concurrency; one request carries group_size rollouts in
    single-turn, so the bare bound in rollouts/s is 0.8 × bare requests/s × rollouts per request)."""
    tidal, bare = cell_result["tidal"], cell_result["bare"]
    per_request = tidal["rollouts_per_s"] / tidal["requests_per_s"] if tidal["requests_per_s"] else math.nan
    vs_bare = tidal["requests_per_s"] / bare["requests_per_s"] if bare["requests_per_s"] else math.nan
    bare_bound = TARGET_BARE_SHARE * bare["requests_per_s"] * per_request
    needed = min(TARGET_ROLLOUTS_PER_S, bare_bound)
    deciding = "5000 rollouts/s" if bare_bound >= TARGET_ROLLOUTS_PER_S else "80% of bare requests/s"
    return {
        "request_rate_vs_bare": vs_bare,
        "rollouts_per_request": per_request,
        "needed_rollouts_per_s": needed,
        "deciding_bound": deciding,
        "lag_ok": tidal["lag_p99_s"] < TARGET_LAG_P99_S,
        "rate_ok": tidal["rollouts_per_s"] >= needed,
    }


def summarize_profile(stats: pstats.Stats, top: int) -> list[dict[str, Any]]:
    """Top functions by own time (tottime), with cumulative time and calls, as JSON rows."""
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{_short(file)}:{line}({name})",
                "calls": calls,
                "own_s": round(tottime, 4),
                "own_share": round(tottime / total, 4) if total else 0.0,
                "cumulative_s": round(cumtime, 4),
            }
        )
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:top]


def group_profile(stats: pstats.Stats) -> dict[str, float]:
    """Own time shared out by the package it is spent in (where the remaining time goes)."""
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    shares: dict[str, float] = {}
    for (file, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        shares[_package(file, name)] = shares.get(_package(file, name), 0.0) + tottime
    return {
        k: round(v / total, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v / total > 0.002
    }


def _short(file: str) -> str:
    for marker in ("site-packages/", "/src/", "lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def _package(file: str, name: str) -> str:
    if file == "~":
        return f"builtin:{name.split(' of ')[0].strip('<>').replace('built-in method ', '')}"
    short = _short(file)
    if short.startswith("tidal/"):
        return "/".join(short.split("/")[:3]).removesuffix(".py")
    if "site-packages/" in file:
        return short.split("/", 1)[0]
    return "stdlib:" + short.split("/")[-1].removesuffix(".py").split(".")[0]


# ---- benchmark-only environment and rewards -------------------------------------------------------------


class FourTurnEnv(MultiTurnEnv):
    """Benchmark-only: reverse_text tasks answered four times ("Again."), scored on the last answer."""

    name = "four_turn"
    max_turns = 4

    def __init__(self, rewards: list[tuple[RewardFn, float]] | None = None):
        self.tasks = ReverseTextEnv()
        super().__init__(rewards)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(reversal_accuracy, 1.0)]

    def num_tasks(self) -> int:
        return self.tasks.num_tasks()

    def task(self, index: int) -> Task:
        return self.tasks.task(index)

    async def env_response(self, task: Task, episode: Episode) -> list[dict[str, Any]] | None:
        return [{"role": "user", "content": "Again."}]


def heavy_reward(task: Task, episode: Episode) -> float:
    """CPU-bound stand-in for a real verifier: edit distance of the answer, 4× repeated, to the target's."""
    completion = (episode.messages[-1]["content"] if episode.messages else "") * 4
    target = task.answer * 4
    previous = list(range(len(target) + 1))
    for i, a in enumerate(completion, 1):
        current = [i]
        for j, b in enumerate(target, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a != b)))
        previous = current
    return 1.0 - previous[-1] / max(len(completion), len(target), 1)


# ---- simulated servers -----------------------------------------------------------------------------------


@contextmanager
def simulated_servers(
    count: int, procs: int, latency: float, vocab: dict[str, int]
) -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """`count` servers over `procs` processes; URLs interleave the processes so any prefix spreads over
    all of them. Every process is stopped on the way out, whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    per = [count // procs + (i < count % procs) for i in range(procs)]
    try:
        for i, ports in enumerate(p for p in per if p):
            started.append(
                subprocess.Popen(
                    [sys.executable, str(REPO / "benchmarks/simulated_vllm.py"), "--ports", str(ports)]
                    + ["--latency", str(latency), "--vocab", json.dumps(vocab), "--seed", str(i)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,  # Ctrl-C reaches us only; we stop them below
                )
            )
        lists = []
        for proc in started:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"simulated server process {proc.pid} exited at start")
            lists.append([f"http://127.0.0.1:{p}" for p in json.loads(line)["ports"]])
        urls = [u for group in itertools.zip_longest(*lists) for u in group if u is not None]
        yield urls, started
    finally:
        for proc in started:
            if proc.stdin is not None:
                proc.stdin.close()  # they exit on stdin EOF
        for proc in started:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- the two clients ---------------------------------------------------------------------------------------


class Window:
    """Counters sampled at the start and end of the measured window, and time spent in garbage collection."""

    def __init__(self, server_pids: Sequence[int]):
        self.server_pids = server_pids
        self.client_pids: Sequence[int] = ()
        """The client's own helper processes (HTTP workers, reward workers): their CPU is the client's."""
        self.gc_seconds = 0.0
        self.gc_by_generation = [0.0, 0.0, 0.0]
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            spent = time.perf_counter() - self._gc_started
            self.gc_seconds += spent
            self.gc_by_generation[info["generation"]] += spent

    def mark(self, rollouts: int, requests: int) -> dict[str, float]:
        return {
            "t": time.perf_counter(),
            "cpu": time.process_time() + cpu_seconds(self.client_pids),
            "main_cpu": time.process_time(),
            "gc": self.gc_seconds,
            "gc2": self.gc_by_generation[2],
            "gc1": self.gc_by_generation[1],
            "servers_cpu": cpu_seconds(self.server_pids),
            "rollouts": rollouts,
            "requests": requests,
        }


def rates(a: dict[str, float], b: dict[str, float], lags: list[float]) -> dict[str, float]:
    seconds = b["t"] - a["t"]
    rollouts, requests = b["rollouts"] - a["rollouts"], b["requests"] - a["requests"]
    lag = lag_metrics(lags)
    return {
        "window_s": seconds,
        "rollouts": rollouts,
        "requests": requests,
        "rollouts_per_s": rollouts / seconds,
        "requests_per_s": requests / seconds,
        "client_cpu_s_per_rollout": (b["cpu"] - a["cpu"]) / max(rollouts, 1),
        "client_cpu_share": (b["cpu"] - a["cpu"]) / seconds,
        "client_event_loop_cpu_share": (b["main_cpu"] - a["main_cpu"]) / seconds,
        "client_gc_share": (b["gc"] - a["gc"]) / seconds,
        "client_gc_share_by_generation": [
            round((b["gc"] - a["gc"] - (b["gc1"] - a["gc1"]) - (b["gc2"] - a["gc2"])) / seconds, 4),
            round((b["gc1"] - a["gc1"]) / seconds, 4),
            round((b["gc2"] - a["gc2"]) / seconds, 4),
        ],
        "servers_cpu_share": (b["servers_cpu"] - a["servers_cpu"]) / seconds,
        "lag_p50_s": lag.get("event_loop/lag_p50_s", math.nan),
        "lag_p99_s": lag.get("event_loop/lag_p99_s", math.nan),
        "lag_max_s": lag.get("event_loop/lag_max_s", math.nan),
        "lag_samples": len(lags),
    }


async def measure(
    count: Any,
    warmup: float,
    seconds: float,
    window: Window,
    lag: LoopLagMonitor,
    profiler: cProfile.Profile | None = None,
) -> dict:
    """Counters and lag over `seconds` after `warmup`; `profiler` (if any) runs over the window only."""
    await asyncio.sleep(warmup)
    lag.take()
    start = window.mark(*count())
    if profiler is not None:
        profiler.enable()
    await asyncio.sleep(seconds)
    if profiler is not None:
        profiler.disable()
    end = window.mark(*count())
    return rates(start, end, lag.take())


async def run_tidal(
    cell: Cell,
    urls: list[str],
    args: argparse.Namespace,
    window: Window,
    workdir: Path,
    profiler: cProfile.Profile | None,
) -> dict:
    from tidal.config.common import ModelConfig
    from tidal.config.rl import BatchConfig, ClientConfig, OrchestratorConfig, SamplingConfig
    from tidal.envs.reward_pool import reward_workers
    from tidal.inference.client import InferenceClient
    from tidal.orchestrator.loop import Orchestrator
    from tidal.testing import TINY_MODEL_NAME

    groups = cell.rollouts_in_flight // args.group_size
    config = OrchestratorConfig(
        output_dir=workdir,
        model=ModelConfig(name=TINY_MODEL_NAME),
        max_async_level=1_000_000,
        sampling=SamplingConfig(max_tokens=args.max_tokens),
        batch=BatchConfig(num_prompts=1_000_000_000, group_size=args.group_size),
        client=ClientConfig(urls=urls, max_in_flight=groups, http_workers=args.http_workers),
        reward_workers=0 if cell.reward == "light" else args.reward_workers,
    )
    orchestrator = Orchestrator(config)  # its environment: reverse_text
    if cell.turns != 1:
        orchestrator.env = FourTurnEnv()
    if cell.reward == "heavy":
        orchestrator.env.rewards = [(heavy_reward, 1.0)]
    finished = [0]
    accept = orchestrator._accept

    def counting_accept(groups_: list, step: int, kept: list, advantages: list, stats: Any) -> None:
        finished[0] += sum(len(g.rollouts) for g in groups_)
        accept(groups_, step, kept, advantages, stats)
        kept.clear()  # shipped, as far as this benchmark goes: an endless step must not hoard every rollout
        advantages.clear()

    orchestrator._accept = counting_accept  # type: ignore[method-assign]
    client = InferenceClient.from_config(  # as Orchestrator.run builds it
        config.client, max_async_level=config.max_async_level
    )
    async with client, reward_workers(config.reward_workers) as reward_pool:  # as Orchestrator.run
        await client.pool.wait_healthy(timeout=30)
        heap = frozen_heap()  # as Orchestrator.run does once set up
        heap.__enter__()
        lag = orchestrator.lag
        lag.start()
        collect = asyncio.create_task(orchestrator._collect(client, 0))

        def count() -> tuple[int, int]:
            workers = client.generation.workers.pids() if client.generation.workers is not None else []
            pool = reward_pool.pids() if reward_pool is not None else []
            window.client_pids = [*workers, *pool]  # sampled as the window starts and ends
            return finished[0], sum(s.requests for s in client.pool.servers.values())

        try:
            warmup, seconds = timing(cell, args)
            warmup += POOL_WARMUP_S if config.reward_workers != 0 else 0.0
            result = await measure(count, warmup, seconds, window, lag, profiler)
        finally:
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            await lag.stop()
            heap.__exit__(None, None, None)
        if collect.done() and not collect.cancelled() and collect.exception() is not None:
            raise collect.exception()  # type: ignore[misc]
    orchestrator.metrics.close()
    result["groups_in_flight"] = groups
    return result


def request_bodies(cell: Cell, args: argparse.Namespace, tokenizer: Any, count: int = 512) -> list[bytes]:
    """The bodies tidal sends for this cell's first prompts (as `InferenceClient.generate` builds them)."""
    from tidal.envs.base import render_prompt
    from tidal.inference.types import SamplingParams

    env = ReverseTextEnv()
    n = args.group_size if cell.turns == 1 else 1
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0).to_vllm()
    bodies = []
    for i in range(count):
        prompt = render_prompt(tokenizer, env.task(i).messages)
        body = {"model": "simulated", "prompt": prompt, "n": n, "logprobs": 0, "return_token_ids": True}
        bodies.append(json.dumps({**body, **sampling}).encode())
    return bodies


def run_bare(cell: Cell, urls: list[str], args: argparse.Namespace, window: Window, tokenizer: Any) -> dict:
    """benchmarks/bare_client.py in a process of its own, at this cell's number of requests in flight."""
    spec = {
        "urls": urls,
        "bodies": [b.decode() for b in request_bodies(cell, args, tokenizer)],
        "concurrency": cell.requests_in_flight(args.group_size),
        "warmup": timing(cell, args)[0],
        "seconds": timing(cell, args)[1],
        "server_pids": list(window.server_pids),
        "rollouts_per_request": args.group_size if cell.turns == 1 else 1 / cell.turns,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
        json.dump(spec, fh)
        fh.flush()
        done = subprocess.run(
            [sys.executable, str(REPO / "benchmarks/bare_client.py"), fh.name],
            capture_output=True,
            text=True,
            timeout=sum(timing(cell, args)) + 120,
        )
    if done.returncode != 0:
        raise RuntimeError(f"bare client failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- driver ------------------------------------------------------------------------------------------------


def tokenizer_and_vocab() -> tuple[Any, dict[str, int]]:
    from tidal.config.common import ModelConfig
    from tidal.inference.tokenizer import load_tokenizer
    from tidal.testing import TINY_MODEL_NAME

    tokenizer = load_tokenizer(ModelConfig(name=TINY_MODEL_NAME))
    vocab = {c: int(tokenizer.convert_tokens_to_ids(c)) for c in "abcdefghijklmnopqrstuvwxyz"}
    return tokenizer, vocab


def run_cell(
    cell: Cell,
    urls: list[str],
    args: argparse.Namespace,
    window: Window,
    tokenizer: Any,
    bare_runs: dict[tuple[int, int, int], list[dict]],
) -> dict:
    """Both clients on one cell; the bare run does not depend on the reward, so reward variants share it."""
    subset = urls[: cell.servers]
    same = (cell.servers, cell.rollouts_in_flight, cell.turns)
    if same not in bare_runs:
        bare_runs[same] = []
    bares, tidals = bare_runs[same], []
    for repeat in range(args.repeats):
        # alternate the two clients, so a change in the machine's other load falls on both alike
        if len(bares) <= repeat:
            gc.collect()
            bares.append(run_bare(cell, subset, args, window, tokenizer))
        gc.collect()
        with tempfile.TemporaryDirectory() as tmp:
            tidals.append(asyncio.run(run_tidal(cell, subset, args, window, Path(tmp), None)))
    result = {**cell.key(), "tidal": median_run(tidals), "bare": median_run(bares[: args.repeats])}
    if args.repeats > 1:
        result["repeats"] = {"tidal": tidals, "bare": bares[: args.repeats]}
    result["verdict"] = verdict(result)
    return result


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median request rate (of an even number, the lower middle one): one real run, so its
    rate, CPU and lag figures belong together."""
    ordered = sorted(runs, key=lambda r: r["requests_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def machine() -> str:
    cores = os.cpu_count()
    return f"{platform.processor() or platform.machine()}, {cores} cores, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="the deciding cell and two neighbours only")
    parser.add_argument("--cells", help="JSON list of cells [servers, rollouts_in_flight, turns, reward]")
    parser.add_argument("--latency", type=float, default=0.5, help="simulated seconds per completion request")
    parser.add_argument("--server-procs", type=int, default=4, help="processes the simulated servers share")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured window per client per cell")
    parser.add_argument(
        "--reward-workers",
        type=int,
        help="orchestrator.reward_workers for the heavy reward (unset: its default; the light one runs inline)",
    )
    parser.add_argument(
        "--http-workers",
        type=int,
        default=0,
        help="orchestrator.client.http_workers: processes that send and parse generation requests",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each client per cell, alternating bare and tidal; the verdict takes each one's median run",
    )
    parser.add_argument(
        "--profile", help="cProfile the deciding cell's tidal run (else the first cell's) into this file"
    )
    args = parser.parse_args(argv)
    cells = [Cell(*c) for c in json.loads(args.cells)] if args.cells else grid(args.quick)
    tokenizer, vocab = tokenizer_and_vocab()
    results = []
    with simulated_servers(max(c.servers for c in cells), args.server_procs, args.latency, vocab) as (
        urls,
        procs,
    ):
        window = Window([p.pid for p in procs])
        bare_runs: dict[tuple[int, int, int], list[dict]] = {}
        for cell in cells:
            try:
                results.append(run_cell(cell, urls, args, window, tokenizer, bare_runs))
            except Exception as exc:  # noqa: BLE001 - one cell past what this machine takes must not end the grid
                results.append({**cell.key(), "error": f"{type(exc).__name__}: {exc}"[:1000]})
                print(f"{cell}: {results[-1]['error']}", flush=True)
                continue
            _print(results[-1])
        if args.profile:  # a run of its own: cProfile slows what it watches
            profiled = next((c for c in cells if c.key() == DECIDING), cells[0])
            profiler = cProfile.Profile()
            with tempfile.TemporaryDirectory() as tmp:
                subset = urls[: profiled.servers]
                under_profile = asyncio.run(run_tidal(profiled, subset, args, window, Path(tmp), profiler))
            profiler.dump_stats(args.profile)
    report = {
        "command": shlex.join(["python", "benchmarks/orchestrator_scale.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "setup": {
            "latency_s": args.latency,
            "server_processes": args.server_procs,
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "warmup_s": args.warmup,
            "window_s": args.seconds,
            "multi_turn_timing": "warm-up + 2 episodes (turns x latency), window >= 3 episodes (`timing`)",
            "reward_workers": {"light": 0, "heavy": args.reward_workers},
            "http_workers": args.http_workers,
            "repeats": args.repeats,
        },
        "cells": results,
    }
    deciding = [r for r in results if {k: r[k] for k in DECIDING} == DECIDING]
    if deciding:
        report["deciding_cell"] = {**DECIDING, **deciding[0]["verdict"]}
    if args.profile:
        stats = pstats.Stats(args.profile)
        report["profile"] = {
            "cell": profiled.key(),
            "what": "cProfile over the measured window of a separate tidal run of this cell (own time)",
            "rates_under_profile": {k: under_profile[k] for k in ("rollouts_per_s", "requests_per_s")},
            "top_own_time": summarize_profile(stats, 25),
            "by_package": group_profile(stats),
        }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _print(r: dict[str, Any]) -> None:
    t, b, v = r["tidal"], r["bare"], r["verdict"]
    print(
        f"{r['servers']:>4} servers {r['rollouts_in_flight']:>6} in flight {r['turns']}-turn {r['reward']:<5} | "
        f"tidal {t['rollouts_per_s']:8.0f} rollouts/s {t['requests_per_s']:7.0f} req/s "
        f"cpu {t['client_cpu_s_per_rollout'] * 1e6:6.0f} µs/rollout gc {t['client_gc_share']:.2f} lag p99 {t['lag_p99_s'] * 1e3:6.1f} ms | "
        f"bare {b['requests_per_s']:7.0f} req/s lag p99 {b['lag_p99_s'] * 1e3:6.1f} ms | "
        f"{v['request_rate_vs_bare']:.2f}x bare",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

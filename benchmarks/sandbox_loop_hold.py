"""How long the sandbox fallback's tool calls hold an orchestrator's event loop: many `bash` calls at once.

A swe run on an H100 (2026-12-06) logged "the event loop was held 3-6 s at once" at every other step: 16
groups × 8 episodes start their tool calls together, and each call of the fallback (`sandbox = "process"`,
no bubblewrap) spawned its child with a `preexec_fn`. With one, subprocess forks the whole parent and waits,
on the calling thread, until the child has run that Python and exec'd. tidal now starts the child without
one (the limits, network namespace and user are set by a prelude in the child: `process_prelude`).

This runs `--calls` `bash` calls at once through `RepoSandbox(mode="process")`, in a process that has torch
and transformers imported and `--ballast-mib` more of resident memory (as an orchestrator has), and
measures this process's CPU seconds, the wall time and the longest gap of a 5 ms timer on the same loop.
The reference, run in the same call, is the old way: the same command and the same limits applied by a
`preexec_fn` (written here for the comparison, not tidal's code).

    python benchmarks/sandbox_loop_hold.py --calls 128 --ballast-mib 2000 --out benchmarks/results/sandbox_loop_hold_cpu.json

On a 2-core machine much of the remaining gap is the children's own start-up competing for the two cores,
not time the loop spends spawning: the parent's CPU seconds separate the two.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch  # noqa: F401  # resident like an orchestrator's
import transformers  # noqa: F401

from tidal.envs.repo_sandbox import RepoSandbox, workspace
from tidal.envs.sandbox import CLONE_NEWNET, Execution
from tidal.envs.swe import write_files

COMMAND = "echo hi && python3 -c 'print(1)'"


def old_way(box: RepoSandbox) -> Callable[[Path], Awaitable[Execution]]:
    """The reference: the same command with the limits, network namespace and user set in a preexec_fn."""
    import ctypes
    import resource

    def limit(uid: int | None) -> None:
        lim = box.limits
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb << 20, lim.memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_mb << 20, lim.max_file_mb << 20))
        if uid is not None:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    async def run(repo: Path) -> Execution:
        from tidal.envs import bwrap

        uid = bwrap.run_as_uid()
        if uid is not None:
            for path in [repo, *repo.rglob("*")]:
                os.chown(path, uid, uid)
        process = await asyncio.create_subprocess_exec(
            "/bin/bash", "-c", COMMAND, cwd=str(repo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda: limit(uid),
            env={"PATH": f"{os.path.dirname(box.python)}:/usr/bin:/bin", "HOME": str(repo)},
        )  # fmt: skip
        output, _ = await process.communicate()
        return Execution(output.decode(errors="replace"), process.returncode, False)

    return run


def new_way(box: RepoSandbox) -> Callable[[Path], Awaitable[Execution]]:
    async def run(repo: Path) -> Execution:
        return await box.run(repo, COMMAND)

    return run


async def one_round(run: Callable[[Path], Awaitable[Execution]], calls: int) -> dict[str, float]:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def timer() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            gaps.append(time.perf_counter() - start - 0.005)

    async def call() -> Execution:
        with workspace("tidal-bench-") as repo:
            write_files(repo, {"pkg/__init__.py": "x = 1\n", "tests/test_pkg.py": "import pkg\n"})
            return await run(repo)

    ticking = asyncio.create_task(timer())
    await asyncio.sleep(0.05)
    wall, cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(call() for _ in range(calls)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stop.set()
    await ticking
    ok = sum(r.returncode == 0 and "hi" in r.output for r in results)
    return {"wall_s": round(wall, 3), "parent_cpu_s": round(cpu, 3), "loop_held_max_s": round(max(gaps), 3),
            "calls_ok": ok}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=128)
    parser.add_argument("--ballast-mib", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ballast = bytearray(args.ballast_mib << 20)
    for i in range(0, len(ballast), 4096):  # resident, not just reserved
        ballast[i] = 1
    box = RepoSandbox(timeout=10, mode="process")
    rounds: dict[str, list[dict[str, float]]] = {"preexec_fn (old)": [], "prelude (tidal)": []}
    for _ in range(args.repeats):  # alternated, so that both see the same machine state
        rounds["preexec_fn (old)"].append(asyncio.run(one_round(old_way(box), args.calls)))
        rounds["prelude (tidal)"].append(asyncio.run(one_round(new_way(box), args.calls)))
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }
    old, new = summary["preexec_fn (old)"], summary["prelude (tidal)"]
    result = {
        "what": "RepoSandbox(mode='process'): N bash calls at once on one event loop, old preexec_fn spawn vs "
        "tidal's prelude (medians of the repeats)",
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.node()}: {os.cpu_count()} cores (usable {len(os.sched_getaffinity(0))})",
        "euid": os.geteuid(),
        "calls": args.calls,
        "ballast_mib": args.ballast_mib,
        "summary": summary,
        "parent_cpu_ratio_new_over_old": round(new["parent_cpu_s"] / old["parent_cpu_s"], 3),
        "loop_held_ratio_new_over_old": round(new["loop_held_max_s"] / old["loop_held_max_s"], 3),
        "rounds": rounds,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

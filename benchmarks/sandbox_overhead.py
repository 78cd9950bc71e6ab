"""Per-call cost of running model-written code under bubblewrap vs the in-process limits (`tidal.envs.sandbox`).

Each mode runs the same snippets `--repeats` times, one call after another (what one rollout's tool call or
one reward's test run waits for): a trivial `print`, and the `code` environment's harness on a reference
solution. Reported: median and p90 wall seconds per call, and bwrap's extra time over the fallback.

    python benchmarks/sandbox_overhead.py --repeats 30 --out benchmarks/results/sandbox_overhead.json
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from tidal.envs import bwrap
from tidal.envs.code_tests import TASKS_FILE, harness_script, load_tasks
from tidal.envs.sandbox import PythonSandbox


def snippets() -> dict[str, str]:
    spec = next(t for t in load_tasks(TASKS_FILE) if t.id == "is_prime")
    reference = next(t for t in json.loads(TASKS_FILE.read_text()) if t["id"] == "is_prime")["reference"]
    return {
        "print": "print(1)",
        "code_harness_is_prime": harness_script(reference, spec.function, [args for args, _ in spec.tests]),
    }


def time_calls(box: PythonSandbox, code: str, repeats: int) -> list[float]:
    async def run() -> list[float]:
        await box.execute(code)  # warm the page cache and the one-time probe/log
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = await box.execute(code)
            seconds.append(time.perf_counter() - start)
            assert not result.failed, result
        return seconds

    return asyncio.run(run())


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_s": round(statistics.median(ordered), 4),
        "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if bwrap.probe() is not None:
        raise SystemExit(f"cannot compare: {bwrap.probe()}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, code in snippets().items():
        results[name] = {
            mode: summary(time_calls(PythonSandbox(timeout=30, mode=mode), code, args.repeats))
            for mode in ("process", "bwrap")
        }
        extra = results[name]["bwrap"]["median_s"] - results[name]["process"]["median_s"]
        results[name]["bwrap_extra_median_s"] = {"seconds": round(extra, 4)}
        print(name, json.dumps(results[name]))
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False).stdout
    report = {
        "command": f"python benchmarks/sandbox_overhead.py --repeats {args.repeats}"
        + (f" --out {args.out}" if args.out else ""),
        "repeats": args.repeats,
        "results": results,
        "bwrap": version.strip(),
        "as_root": os.geteuid() == 0,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

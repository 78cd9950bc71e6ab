"""The tiny-model CPU recipes of the examples: `tidal sft` on an environment's demonstrations, then `tidal rl`.

For each environment named, runs exactly what its README tells a user to run (examples/<env>/sft_tiny.toml,
then examples/<env>/rl_tiny.toml from the SFT's final/) and records, per environment:

- sft: wall time, steps, train loss first and last, held-out greedy exact match of the last turn;
- rl: wall time, steps, the sampled reward (T = 1) of every rollout per 10 steps (`env/<env>/reward/mean`:
  zero-signal groups included), the reward of the trained batch beside it (`reward/batch_mean`: with
  `zero_signal = "drop"` only groups whose rewards differ, so it can rise while the policy does not), and the
  online eval (greedy reward avg@1 and pass@1 on held-out tasks) at each eval step, the first before any update.

Entries are merged into `--out` under `envs`, by environment: a rerun of one environment replaces its entry
only, and the entry it replaces moves into the new one's `earlier` list (READMEs cite old runs).

    python benchmarks/recipes_cpu.py tool_use alphabet_sort --workdir /tmp/recipes --out benchmarks/results/recipes_cpu.json
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from one_gpu_reverse_text import first_last, mean_key, read_jsonl  # the same metric reading

REPO = Path(__file__).resolve().parents[1]

# ---- pure logic ---------------------------------------------------------------------------------------


def blocks(records: Sequence[Mapping[str, Any]], key: str, n: int = 10) -> list[float | None]:
    """Mean of `key` over steps 0..n-1, n..2n-1, ... (rounded for reading)."""
    with_key = [r for r in records if key in r]
    means = [mean_key(with_key[i : i + n], key) for i in range(0, len(with_key), n)]
    return [None if m is None else round(m, 3) for m in means]


def sft_summary(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    steps = [m for m in metrics if "loss" in m]
    exact = [m["eval/exact_match"] for m in metrics if "eval/exact_match" in m]
    return {
        "steps": len(steps),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "heldout_exact_match_last_turn": exact[-1] if exact else None,
    }


def rl_summary(env: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    prefix = f"eval/{env}/"
    online = [
        {"step": r["step"], **{k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}}
        for r in records
        if any(k.startswith(prefix) for k in r)
    ]
    return {
        "steps": sum(1 for r in records if "reward/mean" in r),
        "reward_first_last_10": first_last(records, f"env/{env}/reward/mean"),
        "reward_per_10_steps": blocks(records, f"env/{env}/reward/mean"),
        # runs before 2026-12-02 logged the batch's mean as reward/mean
        "trained_batch_reward_per_10_steps": blocks(
            records, "reward/batch_mean" if any("reward/batch_mean" in r for r in records) else "reward/mean"
        ),
        "zero_signal_groups_per_step": [
            r.get("rollouts/zero_signal_groups") for r in records if "reward/mean" in r
        ],
        "online_eval": [{k: e[k] for k in ("step", "avg@1", "pass@1") if k in e} for e in online],
    }


# ---- running ------------------------------------------------------------------------------------------


def tidal(args: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """Run `python -m tidal ARGS` in the repository, output to `log`: its exit code and wall seconds. Past
    `timeout` it gets SIGTERM, which stops a run and every process it started (what it wrote is kept)."""
    start = time.perf_counter()
    timed_out = False
    with log.open("w") as fh:
        process = subprocess.Popen(
            [sys.executable, "-m", "tidal", *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            process.terminate()
            code = process.wait()
    return {"exit_code": code, "timed_out": timed_out, "wall_s": round(time.perf_counter() - start, 1)}


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return f"{os.cpu_count()} CPU cores ({model}), {platform.system()}"


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def run_env(env: str, workdir: Path, rl_only: bool, timeouts: tuple[float, float]) -> dict[str, Any]:
    sft_dir, rl_dir = workdir / env / "sft", workdir / env / "rl"
    sft_args = ["sft", "@", f"examples/{env}/sft_tiny.toml", "--output-dir", str(sft_dir)]
    rl_args = [
        "rl",
        "@",
        f"examples/{env}/rl_tiny.toml",
        "--model.name",
        str(sft_dir / "final"),
        "--output-dir",
        str(rl_dir),
    ]
    entry: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": commit(),
        "commands": ["tidal " + " ".join(sft_args), "tidal " + " ".join(rl_args)],
    }
    (workdir / env).mkdir(parents=True, exist_ok=True)
    if not rl_only:
        ran = tidal(sft_args, workdir / env / "sft.log", timeouts[0])
        entry["sft"] = {**ran, **sft_summary(read_jsonl(sft_dir / "metrics.jsonl"))}
        if ran["exit_code"] != 0:
            return entry
    ran = tidal(rl_args, workdir / env / "rl.log", timeouts[1])
    entry["rl"] = {**ran, **rl_summary(env, read_jsonl(rl_dir / "orchestrator" / "metrics.jsonl"))}
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("envs", nargs="+")
    parser.add_argument("--workdir", type=Path, required=True, help="run directories go under it (not kept)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--rl-only", action="store_true", help="reuse WORKDIR/<env>/sft (the entry keeps its sft)"
    )
    parser.add_argument("--sft-timeout", type=float, default=420, help="seconds before SIGTERM")
    parser.add_argument("--rl-timeout", type=float, default=480, help="seconds before SIGTERM")
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    entries = results.setdefault("envs", {})
    for env in args.envs:
        entry = run_env(env, args.workdir, args.rl_only, (args.sft_timeout, args.rl_timeout))
        previous = entries.get(env, {})
        if args.rl_only and "sft" in previous:
            entry["sft"] = previous["sft"]
        if previous:  # the README may cite it: kept, newest first
            entry["earlier"] = [
                {k: v for k, v in previous.items() if k != "earlier"},
                *previous.get("earlier", []),
            ]
        entries[env] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({env: entry}, indent=1), flush=True)


if __name__ == "__main__":
    main()

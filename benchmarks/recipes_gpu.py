"""The one-GPU recipes of the examples: `tidal sft` then `tidal rl`, for several environments on one GPU at once.

For each environment named, runs what its README tells a user with one GPU to run
(examples/<env>/sft_one_gpu.toml, then examples/<env>/rl_one_gpu.toml from the SFT's final/) and records
the same summary as benchmarks/recipes_cpu.py: SFT loss and held-out greedy exact match; RL sampled reward
per 10 steps and the online eval (greedy reward on held-out tasks) before the first update and after.

Several environments share the GPU: every SFT runs at once (`--phase sft`), then the RL runs start one
after another (`--phase rl`), each once the one before has its vLLM server answering /health. vLLM sizes its
KV cache from the device's free memory while it starts, and fails if another process frees GPU memory
during that window; staggered starts after every SFT has exited keep that from happening.

    python benchmarks/recipes_gpu.py alphabet_sort math --phase both --workdir /root/recipes \
        --out /root/out/recipes_gpu.json --deadline 560
"""

import argparse
import json
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

from one_gpu_reverse_text import read_jsonl
from recipes_cpu import commit, machine, rl_summary, sft_summary  # the same summaries as the CPU recipes

REPO = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "no GPU found"


def commands(env: str, workdir: Path) -> tuple[list[str], list[str]]:
    sft_dir, rl_dir = workdir / env / "sft", workdir / env / "rl"
    sft = ["sft", "@", f"examples/{env}/sft_one_gpu.toml", "--output-dir", str(sft_dir)]
    rl = ["rl", "@", f"examples/{env}/rl_one_gpu.toml", "--model.name", str(sft_dir / "final"),
          "--output-dir", str(rl_dir)]  # fmt: skip
    return sft, rl


def start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tidal", *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT
        )


def finish(process: subprocess.Popen, started: float, deadline: float) -> dict[str, Any]:
    """Wait for `process` until the absolute `deadline` (time.monotonic), then SIGTERM it: a stopped run
    stops every process it started and keeps what it wrote."""
    timed_out = False
    try:
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        process.terminate()
        code = process.wait()
    return {"exit_code": code, "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 1)}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def rl_port(env: str) -> int:
    config = tomllib.loads((REPO / "examples" / env / "rl_one_gpu.toml").read_text())
    return int(config["inference"]["server"]["port"])


def run_sfts(envs: list[str], workdir: Path, deadline: float) -> dict[str, dict[str, Any]]:
    running = {}
    for env in envs:
        (workdir / env).mkdir(parents=True, exist_ok=True)
        running[env] = (start(commands(env, workdir)[0], workdir / env / "sft.log"), time.monotonic())
    results = {}
    for env, (process, started) in running.items():
        ran = finish(process, started, deadline)
        results[env] = {**ran, **sft_summary(read_jsonl(workdir / env / "sft" / "metrics.jsonl"))}
        print(f"[recipes] {env} sft: {results[env]}", flush=True)
    return results


def run_rls(
    envs: list[str], workdir: Path, deadline: float, health_timeout: float
) -> dict[str, dict[str, Any]]:
    running = {}
    for env in envs:
        if not (workdir / env / "sft" / "final" / "config.json").exists():
            print(f"[recipes] {env}: no SFT final/, RL skipped", flush=True)
            continue
        process, started = start(commands(env, workdir)[1], workdir / env / "rl.log"), time.monotonic()
        running[env] = (process, started)
        port, waited_until = rl_port(env), min(deadline, time.monotonic() + health_timeout)
        while time.monotonic() < waited_until and process.poll() is None and not healthy(port):
            time.sleep(1.0)
        print(f"[recipes] {env} rl: server up after {time.monotonic() - started:.0f} s", flush=True)
    results = {}
    for env, (process, started) in running.items():
        ran = finish(process, started, deadline)
        records = read_jsonl(workdir / env / "rl" / "orchestrator" / "metrics.jsonl")
        results[env] = {**ran, **rl_summary(env, records)}
        print(f"[recipes] {env} rl: {results[env]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("envs", nargs="+")
    parser.add_argument("--workdir", type=Path, required=True, help="run directories go under it")
    parser.add_argument(
        "--out", type=Path, required=True, help="results JSON (entries merged by environment)"
    )
    parser.add_argument("--phase", choices=["sft", "rl", "both"], default="both")
    parser.add_argument(
        "--deadline", type=float, default=540, help="seconds from now when every run is stopped"
    )
    parser.add_argument(
        "--sft-share", type=float, default=0.45, help="with --phase both: SFT's share of the time"
    )
    parser.add_argument(
        "--health-timeout", type=float, default=180, help="seconds to wait for each RL server"
    )
    args = parser.parse_args()
    t0 = time.monotonic()
    end = t0 + args.deadline
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for env in args.envs:
        entry = results.setdefault(env, {})
        entry.update({"machine": f"{gpu_name()}, {machine()}", "commit": commit()})
        entry["commands"] = ["tidal " + " ".join(c) for c in commands(env, args.workdir)]
    if args.phase in ("sft", "both"):
        sft_end = t0 + args.deadline * args.sft_share if args.phase == "both" else end
        for env, summary in run_sfts(args.envs, args.workdir, sft_end).items():
            results[env]["sft"] = summary
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.phase in ("rl", "both"):
        for env, summary in run_rls(args.envs, args.workdir, end, args.health_timeout).items():
            results[env]["rl"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

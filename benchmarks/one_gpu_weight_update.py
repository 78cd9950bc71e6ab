"""Publish + load of each step's weights inside `tidal rl` on one GPU: filesystem against cuda_ipc, one call.

Runs `tidal rl` with examples/reverse_text/rl_one_gpu.toml (vLLM bf16 beside an fp32-master trainer on GPU 0)
once per backend, on the random Qwen3-0.6B-shape model (no SFT, no download) and synchronously
(max_async_level 0: the orchestrator waits for each step's weights, so nothing is in flight while a server
loads and the load time is the update alone). Random weights earn no reward, so groups are kept
(`zero_signal = "keep"`) to give every step a batch. Per backend, over the steps after the first `--skip`:

- publish: the trainer's `time/publish` (cast and write: files, or the in-place copy into the shared buffer);
- load: the orchestrator's time per weight update (pause, load, resume and the HTTP calls around them);
- engine load: what the `cuda_ipc` engine itself reports per load in the vLLM log;
- mismatch KL between trainer and vLLM (the served weights must be the trainer's).

    python benchmarks/one_gpu_weight_update.py --workdir /root/w --out benchmarks/results/one_gpu_weight_update_h200.json
"""

import argparse
import json
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from one_gpu_reverse_text import _commit, _device, mean_key, read_jsonl  # the same metric reading

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = "examples/reverse_text/rl_one_gpu.toml"
MODEL = "tidal-testing/random-qwen3-0.6b"
BACKENDS = {
    "filesystem": ["--trainer.publish.type", "filesystem"],
    "cuda_ipc": ["--trainer.publish.type", "cuda_ipc"],
    "cuda_ipc_direct": ["--trainer.publish.type", "cuda_ipc", "--inference.weights.load", "direct"],
}
ENGINE_LINE = re.compile(r"tidal cuda_ipc: loaded step (\d+).* in ([0-9.]+) ms")

# ---- pure logic ---------------------------------------------------------------------------------------


def load_seconds(orchestrator: Sequence[Mapping[str, Any]], skip: int) -> list[float]:
    """Seconds of each weight update after step `skip`, from the orchestrator's running total."""
    rows = [r for r in orchestrator if "time/weight_updates_total" in r and "weights/updates_total" in r]
    out = []
    for before, after in zip(rows, rows[1:], strict=False):
        updates = after["weights/updates_total"] - before["weights/updates_total"]
        if after["step"] > skip and updates > 0:
            out.append((after["time/weight_updates_total"] - before["time/weight_updates_total"]) / updates)
    return out


def engine_load_ms(log_text: str, skip: int) -> list[float]:
    return [float(ms) for step, ms in ENGINE_LINE.findall(log_text) if int(step) > skip]


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "mean": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "max": max(values),
        "n": len(values),
    }


def backend_result(out_dir: Path, skip: int) -> dict[str, Any]:
    trainer = read_jsonl(out_dir / "trainer" / "metrics.jsonl")
    orchestrator = read_jsonl(out_dir / "orchestrator" / "metrics.jsonl")
    publish = [float(r["time/publish"]) for r in trainer if r["step"] >= skip and "time/publish" in r]
    load = load_seconds(orchestrator, skip)
    logs = "".join(p.read_text(errors="replace") for p in sorted((out_dir / "logs").glob("*.log")))
    result: dict[str, Any] = {
        "trainer_steps": len(trainer),
        "publish_s": summary(publish),
        "load_s": summary(load),
        "engine_load_ms": summary(engine_load_ms(logs, skip)),
        "mismatch_kl_mean": mean_key(trainer, "mismatch_kl/mean"),
        "trainer_step_s": mean_key([r for r in trainer if r["step"] >= skip], "time/step"),
        "weight_files": len(list((out_dir / "weights").rglob("*.safetensors"))),
    }
    medians = (result["publish_s"]["median"], result["load_s"]["median"])
    result["publish_plus_load_s"] = None if None in medians else sum(medians)
    return result


# ---- the runs -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_backend(args: argparse.Namespace, name: str) -> dict[str, Any]:
    out_dir = Path(args.workdir) / name
    argv = [
        sys.executable, "-m", "tidal", "rl", "@", args.rl_config,
        "--output-dir", str(out_dir),
        "--model.name", args.model,
        "--max-steps", str(args.steps),
        "--max-async-level", "0",
        "--orchestrator.batch.zero-signal", "keep",
        "--orchestrator.online-eval.interval", "100000",  # step 0 only
        "--orchestrator.online-eval.num-tasks", "8",
        "--trainer.ckpt.interval", "100000",
        "--inference.server.port", str(free_port()),
        "--inference.vllm.enforce-eager", "true" if args.eager else "false",
        *BACKENDS[name], *args.rl_args,
    ]  # fmt: skip
    print("$", shlex.join(argv), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=REPO)
    try:
        rc = child.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.terminate()  # the launcher stops vLLM and the trainer, which the next run needs the GPU of
        rc = child.wait(timeout=90)
    result = {"command": shlex.join(argv[1:]), "exit_code": rc, "wall_s": time.perf_counter() - start}
    result.update(backend_result(out_dir, args.skip))
    print(json.dumps({name: result}, indent=1), flush=True)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="outputs/bench/one_gpu_weights")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"comma-separated, of {list(BACKENDS)}"
    )
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rl-config", default=RL_CONFIG)
    parser.add_argument("--rl-args", default="", help="extra flags for every tidal rl (one string)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the statistics (warm-up)")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (starts faster)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per tidal rl run")
    args = parser.parse_args(argv)
    args.rl_args = shlex.split(args.rl_args)
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "what": "publish + load per step inside tidal rl on one GPU (random Qwen3-0.6B shape, bf16 served, "
        "fp32 masters, synchronous): filesystem against cuda_ipc",
        "command": shlex.join(["python", "benchmarks/one_gpu_weight_update.py", *(argv or sys.argv[1:])]),
        "device": _device(),
        "commit": _commit(),
        "backends": {},
    }
    for name in args.backends.split(","):
        result["backends"][name] = run_backend(args, name)
        if args.out:  # written after every run: a later one that times out leaves the earlier ones
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    files = result["backends"].get("filesystem", {}).get("publish_plus_load_s")
    for name, row in result["backends"].items():
        if name != "filesystem" and files and row.get("publish_plus_load_s"):
            row["speedup_vs_filesystem"] = files / row["publish_plus_load_s"]
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one-GPU path at a real model's size: reverse_text SFT from random init, then `tidal rl` on the same GPU.

Runs exactly what a user with one GPU runs (examples/reverse_text/{sft,rl}_one_gpu.toml): `tidal sft` on the
Qwen3-0.6B-shape random model (char tokenizer padded to Qwen3's vocabulary), then `tidal rl` from its
final/ with vLLM (bf16, CUDA graphs) and the trainer (fp32 master weights) sharing GPU 0 and weights going
through the filesystem. While RL runs it samples `nvidia-smi` every 0.5 s and attributes each process's GPU
memory to its role (inference, trainer) through the launcher's process tree. It reports:

- sft: wall time, train loss at the end, held-out greedy exact match;
- rl: reward of the first and last 10 steps, online-eval exact match, mismatch KL between trainer and vLLM,
  seconds per step split into generation, weight load, trainer forward/backward and publish, peak GPU memory
  of each role.

    python benchmarks/one_gpu_reverse_text.py --workdir /root/w --out benchmarks/results/one_gpu_reverse_text_h200.json
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = "examples/reverse_text/sft_one_gpu.toml"
RL_CONFIG = "examples/reverse_text/rl_one_gpu.toml"

# ---- pure logic ---------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_key(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else None


def first_last(records: Sequence[Mapping[str, Any]], key: str, n: int = 10) -> dict[str, float | None]:
    with_key = [r for r in records if key in r]
    return {"first": mean_key(with_key[:n], key), "last": mean_key(with_key[-n:], key)}


def step_breakdown(
    trainer: Sequence[Mapping[str, Any]], orchestrator: Sequence[Mapping[str, Any]], skip: int
) -> dict[str, float | None]:
    """Mean seconds per step of each part over the steps after the first `skip` (compilation, warm-up)."""
    tr = [r for r in trainer if r["step"] >= skip]
    orch = [r for r in orchestrator if r["step"] >= skip]
    out: dict[str, float | None] = {
        "trainer_step_s": mean_key(tr, "time/step"),
        "trainer_wait_for_data_s": mean_key(tr, "time/wait_for_data"),
        "trainer_forward_backward_s": mean_key(tr, "time/forward_backward"),
        "trainer_publish_s": mean_key(tr, "time/publish"),
        "trainer_tokens_per_s": mean_key(tr, "tokens_per_s"),
        "orchestrator_step_s": mean_key(orch, "time/step"),
        "orchestrator_wait_for_policy_s": mean_key(orch, "time/wait_for_policy"),
    }
    step_s, wait_s = out["orchestrator_step_s"], out["orchestrator_wait_for_policy_s"]
    out["generation_s"] = step_s - wait_s if step_s is not None and wait_s is not None else None
    versioned = [r for r in orch if "policy_version" in r and "time/weight_updates_total" in r]
    if len(versioned) >= 2:
        updates = versioned[-1]["policy_version"] - versioned[0]["policy_version"]
        seconds = versioned[-1]["time/weight_updates_total"] - versioned[0]["time/weight_updates_total"]
        out["weight_load_s"] = seconds / updates if updates else None
    return out


def role_of(cmdline: Sequence[str]) -> str | None:
    """Which `tidal rl` role a process belongs to, from its command line (the launcher starts each as
    `python -m tidal <role> @ <configs/role.toml>`; vLLM's engine processes inherit nothing we can read,
    so they are attributed through their ancestor in `attribute`)."""
    text = " ".join(cmdline)
    for role in ("inference", "trainer", "orchestrator"):
        if f"tidal {role}" in text or f"configs/{role}.toml" in text:
            return role
    return None


# ---- sampling a live run --------------------------------------------------------------------------------


class GpuMemorySampler(threading.Thread):
    """Every `interval` s: each GPU process's used memory (nvidia-smi), attributed to a role by ancestry."""

    def __init__(self, root_pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.root_pid, self.interval = root_pid, interval
        self.peak_by_role: dict[str, float] = {}
        self.peak_total_mib = 0.0
        self.unattributed_mib = 0.0
        self.num_samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self._sample()
            except (OSError, subprocess.SubprocessError, ValueError):
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def _sample(self) -> None:
        import psutil

        apps = _nvidia_smi(["--query-compute-apps=pid,used_memory"])
        total = _nvidia_smi(["--query-gpu=memory.used"])
        if total:
            self.peak_total_mib = max(self.peak_total_mib, float(total[0][0]))
        by_role: dict[str, float] = {}
        for pid_text, mib_text in apps:
            role = self._attribute(psutil, int(pid_text))
            if role is None:
                self.unattributed_mib = max(self.unattributed_mib, float(mib_text))
                continue
            by_role[role] = by_role.get(role, 0.0) + float(mib_text)
        for role, mib in by_role.items():
            self.peak_by_role[role] = max(self.peak_by_role.get(role, 0.0), mib)
        self.num_samples += 1

    def _attribute(self, psutil: Any, pid: int) -> str | None:
        try:
            proc = psutil.Process(pid)
            chain = [proc, *proc.parents()]
        except psutil.Error:
            return None
        if not any(p.pid == self.root_pid for p in chain):
            return None
        for p in chain:
            try:
                role = role_of(p.cmdline())
            except psutil.Error:
                continue
            if role is not None:
                return role
        return None


def _nvidia_smi(query: list[str]) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]


# ---- the two runs ---------------------------------------------------------------------------------------


def tidal_argv(command: str, config: str, output_dir: Path, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "tidal", command, "@", config, "--output-dir", str(output_dir), *extra]


def run_sft(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.workdir) / "sft"
    argv = tidal_argv("sft", args.sft_config, out_dir, args.sft_args)
    print("$", shlex.join(argv), flush=True)
    start = time.perf_counter()
    rc = subprocess.run(argv, cwd=REPO, timeout=args.sft_timeout).returncode
    seconds = time.perf_counter() - start
    records = read_jsonl(out_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evaluated = [r for r in records if "eval/exact_match" in r]
    return {
        "command": shlex.join(argv[1:]),
        "exit_code": rc,
        "wall_s": seconds,
        "steps": len(train),
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
        "train_tokens_per_s": mean_key(train[len(train) // 2 :], "tokens_per_s"),
        "time_per_step_s": mean_key(train[len(train) // 2 :], "time/step"),
        "heldout_exact_match": evaluated[-1]["eval/exact_match"] if evaluated else None,
        "final_dir": str(out_dir / "final"),
    }


def run_rl(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    out_dir = Path(args.workdir) / "rl"
    argv = tidal_argv("rl", args.rl_config, out_dir, ["--model.name", model_dir, *args.rl_args])
    print("$", shlex.join(argv), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=REPO)
    sampler = GpuMemorySampler(child.pid)
    sampler.start()
    try:
        rc = child.wait(timeout=args.rl_timeout)
    except subprocess.TimeoutExpired:
        child.terminate()  # the launcher stops its children and checkpoints
        rc = child.wait(timeout=60)
    finally:
        sampler.stop()
    seconds = time.perf_counter() - start
    trainer = read_jsonl(out_dir / "trainer" / "metrics.jsonl")
    orchestrator = read_jsonl(out_dir / "orchestrator" / "metrics.jsonl")
    evals = {k: [(r["step"], r[k]) for r in orchestrator if k in r] for k in _eval_keys(orchestrator)}
    return {
        "command": shlex.join(argv[1:]),
        "exit_code": rc,
        "wall_s": seconds,
        "trainer_steps": len(trainer),
        "reward_first_last_10": first_last(orchestrator, "reward/mean"),
        "mismatch_kl_first_last_10": first_last(trainer, "mismatch_kl/mean"),
        "mismatch_kl_mean": mean_key(trainer, "mismatch_kl/mean"),
        "online_eval": evals,
        "seconds_per_step": step_breakdown(trainer, orchestrator, skip=args.skip_steps),
        "peak_gpu_memory_gib": {role: mib / 1024 for role, mib in sampler.peak_by_role.items()},
        "peak_gpu_memory_total_gib": sampler.peak_total_mib / 1024,
        "trainer_peak_allocated_gib": max(
            (r["memory/peak_allocated_gib"] for r in trainer if "memory/peak_allocated_gib" in r),
            default=None,
        ),
        "trainer_peak_reserved_gib": max(
            (r["memory/peak_reserved_gib"] for r in trainer if "memory/peak_reserved_gib" in r), default=None
        ),
        "memory_samples": sampler.num_samples,
    }


def _eval_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith("eval/")})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="outputs/bench/one_gpu")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument("--sft-config", default=SFT_CONFIG)
    parser.add_argument("--rl-config", default=RL_CONFIG)
    parser.add_argument("--sft-args", default="", help="extra flags for tidal sft (one string)")
    parser.add_argument("--rl-args", default="", help="extra flags for tidal rl (one string)")
    parser.add_argument("--skip-sft", action="store_true", help="reuse <workdir>/sft/final")
    parser.add_argument("--skip-rl", action="store_true")
    parser.add_argument("--sft-timeout", type=float, default=400)
    parser.add_argument("--rl-timeout", type=float, default=480)
    parser.add_argument("--skip-steps", type=int, default=3, help="steps left out of the per-step means")
    args = parser.parse_args(argv)
    args.sft_args, args.rl_args = shlex.split(args.sft_args), shlex.split(args.rl_args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "what": "reverse_text on one GPU: SFT from random init (Qwen3-0.6B shape), then tidal rl sharing the GPU",
        "command": shlex.join(["python", "benchmarks/one_gpu_reverse_text.py", *(argv or sys.argv[1:])]),
        "device": _device(),
        "commit": _commit(),
    }
    final = str(Path(args.workdir) / "sft" / "final")
    if not args.skip_sft:
        result["sft"] = run_sft(args)
        print(json.dumps(result["sft"], indent=1), flush=True)
    if not args.skip_rl:
        result["rl"] = run_rl(args, final)
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def _device() -> str:
    try:
        return ", ".join(" ".join(row) for row in _nvidia_smi(["--query-gpu=name,memory.total"]))
    except (OSError, subprocess.SubprocessError):
        return "no GPU"


def _commit() -> str | None:
    if os.environ.get("TIDAL_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["TIDAL_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return head.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())

"""On-policy distillation against RL, and a curriculum against uniform order, at an equal generation budget,
on a real teacher and student (issue 38).

The teacher is a real model (the Qwen2.5-Coder-0.5B-Instruct GGUF from the real-model issue, converted); the
student is the teacher without some decoder layers (`drop_layers`, `--drop`): the same tokenizer, less depth,
a model that starts below the teacher. Without layers 8 and 16 it keeps the teacher's step-by-step style on
math word problems but not its answers: held-out greedy 0.02 against the teacher's 0.94
(benchmarks/distill_student_probe.py --level word_problems; results/distill_student_probe_word_problems_cpu.json).
Dropping every other layer leaves it writing garbage. From the student, side by side on one GPU (each vLLM
with a fixed KV cache, as benchmarks/real_models.py runs its recipes):

    rl:         tidal rl @ examples/distill/rl_math.toml       (the environment's reward alone, uniform order)
    curriculum: tidal rl @ examples/distill/rl_math_curriculum.toml  (the same with [orchestrator.curriculum])
    distill:    tidal rl @ examples/distill/rl_math_distill.toml  (the teacher's reverse KL alone; tidal rl
                serves the teacher, `[teacher_server]`)

All three draw from the same pool of 256 problems with the same group size and max tokens. Equal steps are
not equal generation: RL pays for the zero-signal groups it drops, distillation keeps every group (8.5x fewer
tokens in 10 steps on one H100, results/distill_curriculum_h100.json). With `--budget N` each run stops at its
first online eval whose policy was trained on N of generation (`--budget-unit samples`: completions sampled,
dropped groups included; or `tokens`: completion tokens), and that eval is its score at the budget, with the
eval before it beside it (`--eval-interval` sets how close the two are). Reported per run: held-out greedy
avg@1 at each eval with the generation behind it, wall time (to the budget's eval; the runs share one GPU),
tokens and samples generated, groups run and kept, the reward and the reverse KL (distill) per step.
`--runs` picks a subset.

    python benchmarks/distill_vs_rl.py --teacher /root/models/qwen2.5-coder-0.5b-instruct.gguf --drop 8,16 \\
        --workdir /root/dv --out /root/out/distill_curriculum.json --steps 40 --budget 5120 --eval-interval 2
    python benchmarks/distill_vs_rl.py --cpu --teacher tidal-testing/tiny-qwen3 --workdir /tmp/dv \\
        --out /tmp/dv.json --steps 6 --budget 12 --eval-interval 2  # the whole path on CPU, tiny model
    python benchmarks/distill_vs_rl.py student TEACHER OUT_DIR [8,16]   # only make the student
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from real_models import REPO, SHARED_GPU_FLAGS, online_evals, score, tidal  # a sibling benchmark

# SHARED_GPU_FLAGS: every vLLM here (both students' and the teacher's) with a fixed 4 GiB KV cache, so that
# they share the GPU, as real_models.py's recipes do
CPU_FLAGS = [
    "--inference.vllm.enforce-eager", "true", "--model.dtype", "float32",
    "--orchestrator.batch.num-prompts", "2", "--orchestrator.batch.group-size", "2",
    "--orchestrator.sampling.max-tokens", "8", "--orchestrator.online-eval.num-tasks", "2",
    "--inference.vllm.max-model-len", "512", "--orchestrator.batch.seq-len", "512",
    "--trainer.scheduler.warmup-steps", "0",  # the recipes warm the lr up over 5 steps; a smoke run has 2
]  # fmt: skip
"""The CPU smoke run: the tiny model, a few tokens."""


def load_student(source: str, drop: list[int] | None = None) -> Any:
    """The model at `source` (an HF directory) without the decoder layers numbered in `drop` (None: every
    other one, the second, the fourth, …), in float32: a student of the same tokenizer and less depth."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    layers = model.model.layers
    dropped = set(range(1, len(layers), 2) if drop is None else drop)
    if not dropped <= set(range(len(layers))):
        raise SystemExit(f"drop_layers: the teacher has layers 0-{len(layers) - 1}, not {sorted(dropped)}")
    kept = [i for i in range(len(layers)) if i not in dropped]
    model.model.layers = torch.nn.ModuleList(layers[i] for i in kept)
    for new_index, layer in enumerate(model.model.layers):  # the KV cache is indexed by it
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_index
    config = model.config
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, len(kept))
    return model


def drop_layers(teacher: str, out: Path, drop: list[int] | None = None) -> Path:
    """`load_student` of the teacher (a .gguf, an HF directory or a hub id), written to `out` with the
    teacher's tokenizer."""
    from transformers import AutoTokenizer

    from tidal.models import resolve_model_name

    source = resolve_model_name(teacher, lambda line: print(f"[distill_vs_rl] {line}", flush=True))
    model = load_student(source, drop)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    layers = model.config.num_hidden_layers
    print(
        f"[distill_vs_rl] student: {layers} layers of {teacher} (without {drop or 'every other'}) -> {out}",
        flush=True,
    )
    return out


def parse_drop(text: str) -> list[int]:
    """`--drop 20,21,22` as layer numbers."""
    return [int(part) for part in text.split(",") if part.strip()]


def run_rl(
    config: Path, student: Path, out: Path, port: int, extra: list[str], log: Path
) -> tuple[subprocess.Popen, str]:
    """Start one `tidal rl` from the student, its output in `log`; the process and its command line."""
    args = [
        "rl", "@", str(config), "--model.name", str(student), "--output-dir", str(out),
        "--inference.server.port", str(port), *extra,
    ]  # fmt: skip
    return tidal(args, log), "tidal " + " ".join(args)


def summary(run: Path, wall: float, code: int | None, command: str) -> dict[str, Any]:
    """What one run measured: held-out at step 0 and at the end, tokens generated, KL per step, wall time."""
    rows = read_rows(run)
    heldout = [
        {"step": e["step"], "final": e["final"], **score(report)}
        for e in online_evals(run)
        for report in e["envs"].values()
        if "avg@1" in report
    ]
    return {
        "command": command,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "steps": len(rows),
        "tokens_generated": sum(r.get("rollouts/tokens_generated", 0) for r in rows),
        # generation per kept group: what a curriculum should lower (zero-signal groups are paid, then dropped)
        "groups_run": sum(r.get("rollouts/groups_run", 0) for r in rows),
        "groups_kept": sum(r.get("rollouts/groups_kept", 0) for r in rows),
        "zero_signal_groups": sum(r.get("rollouts/zero_signal_groups", 0) for r in rows),
        "sum_step_time_s": round(sum(r.get("time/step", 0.0) for r in rows), 1),
        "heldout": heldout,
        "reward_per_step": [round(r["reward/mean"], 4) for r in rows],
        "reverse_kl_per_step": [round(r["distill/reverse_kl"], 4) for r in rows if "distill/reverse_kl" in r],
    }


def spent_before(rows: list[dict[str, Any]], step: int, unit: str, group_size: int) -> float:
    """The generation that trained the policy of `step` (the batches of the steps before it), in `unit`:
    tokens (completion tokens generated) or samples (completions sampled, kept groups or not)."""
    earlier = [row for row in rows if row["step"] < step]
    if unit == "tokens":
        return float(sum(row.get("rollouts/tokens_generated", 0) for row in earlier))
    return float(group_size * sum(row.get("rollouts/groups_run", 0) for row in earlier))


def scored_evals(
    rows: list[dict[str, Any]], evals: list[dict[str, Any]], unit: str, group_size: int
) -> list[dict[str, Any]]:
    """Each online eval in step order: its step, the generation that trained its policy, its held-out score."""
    scored = []
    for record in sorted(evals, key=lambda e: e["step"]):
        reports = [report for report in record["envs"].values() if "avg@1" in report]
        if reports:
            spent = spent_before(rows, record["step"], unit, group_size)
            scored.append({"step": record["step"], unit: spent, "heldout": score(reports[0])})
    return scored


def at_budget(scored: list[dict[str, Any]], budget: float, unit: str) -> dict[str, Any] | None:
    """Of `scored_evals`, the first eval whose policy was trained on at least `budget` of generation, with
    the eval before it (the budget lies between the two); None while no eval has reached it."""
    for index, entry in enumerate(scored):
        if entry[unit] >= budget:
            return {
                "budget": budget,
                "unit": unit,
                "at": entry,
                "before": scored[index - 1] if index else None,
            }
    return None


def read_rows(run: Path) -> list[dict[str, Any]]:
    logged = run / "orchestrator" / "metrics.jsonl"  # absent before a run's first step
    return [json.loads(line) for line in logged.read_text().splitlines()] if logged.exists() else []


def group_size_of(config: Path, cpu: bool) -> int:
    """The recipe's group size (the CPU smoke run overrides it with 2)."""
    import tomllib

    return 2 if cpu else int(tomllib.loads(config.read_text())["orchestrator"]["batch"]["group_size"])


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (tidal rl stops its children and keeps what it wrote), then SIGKILL after two minutes."""
    process.terminate()
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "student":
        drop_layers(sys.argv[2], Path(sys.argv[3]), parse_drop(sys.argv[4]) if len(sys.argv) > 4 else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True, help="the teacher: a .gguf, an HF directory or a hub id")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--drop",
        default=None,
        help="the teacher's layers the student lacks, e.g. 20,21,22 (default: every other)",
    )
    parser.add_argument("--cpu", action="store_true", help="the tiny CPU smoke run (no GPU flags)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds the runs may take")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["rl", "curriculum", "distill"],
        choices=["rl", "curriculum", "distill"],
        help="which of the three (side by side)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="stop each run at its first online eval trained on this much generation (0: run --steps steps)",
    )
    parser.add_argument("--budget-unit", choices=["tokens", "samples"], default="samples")
    parser.add_argument(
        "--eval-interval", type=int, default=0, help="every run's online eval interval (0: the recipes' own)"
    )
    args = parser.parse_args()
    student = drop_layers(
        args.teacher, args.workdir / "student", parse_drop(args.drop) if args.drop else None
    )
    common = ["--max-steps", str(args.steps), *(CPU_FLAGS if args.cpu else SHARED_GPU_FLAGS)]
    if args.eval_interval:
        common += ["--orchestrator.online-eval.interval", str(args.eval_interval)]
    teacher_flags = ["--teacher-server.model", args.teacher]
    runs = {
        "rl": (REPO / "examples/distill/rl_math.toml", 18960, common),
        "curriculum": (REPO / "examples/distill/rl_math_curriculum.toml", 18962, common),
        "distill": (REPO / "examples/distill/rl_math_distill.toml", 18961, [*common, *teacher_flags]),
    }
    runs = {name: run for name, run in runs.items() if name in args.runs}
    started, begun, group_sizes = {}, time.monotonic(), {}
    for name, (config, port, extra) in runs.items():
        out = args.workdir / name
        process, command = run_rl(config, student, out, port, extra, args.workdir / f"{name}.log")
        started[name] = (process, out, command)
        group_sizes[name] = group_size_of(config, args.cpu)
    document = {
        "what": "issue 38: on-policy distillation against RL, and a curriculum against uniform order, from the same"
        " student on the same pool of problems, at an equal generation budget (`budget`; without one, the"
        " same number of steps: compare tokens_generated)",
        "teacher": args.teacher,
        "student": f"{student}: the teacher without layers {args.drop or 'every other'}",
        "cpu_smoke": args.cpu,
        "budget": {"amount": args.budget, "unit": args.budget_unit} if args.budget else None,
        "runs": {},
    }
    deadline = begun + args.timeout
    while started:  # each run's wall time is its own: poll them all, and write the file as each one ends
        time.sleep(2.0)
        late = time.monotonic() > deadline
        for name, (process, out, command) in list(started.items()):
            reached = None
            if args.budget:  # the eval that closes the budget is written: this run has had its share
                scored = scored_evals(read_rows(out), online_evals(out), args.budget_unit, group_sizes[name])
                reached = at_budget(scored, args.budget, args.budget_unit)
            if process.poll() is None and not late and reached is None:
                continue
            wall = time.monotonic() - begun  # before the stop: its wall time to the budget's eval
            if process.poll() is None:
                stop(process)
            result = summary(out, wall, process.returncode, command)
            result["samples_generated"] = group_sizes[name] * result["groups_run"]
            result["stopped_by_deadline"] = late and reached is None
            if args.budget:
                # read again after the stop: the evals it wrote meanwhile are in the report too
                scored = scored_evals(read_rows(out), online_evals(out), args.budget_unit, group_sizes[name])
                result["evals_by_generation"] = scored
                result["budget_reached"] = reached is not None
                # not reached (deadline, or a failure): its last eval, short of the budget
                result["at_budget"] = reached or {"at": scored[-1] if scored else None, "short": True}
            document["runs"][name] = result
            del started[name]
            print(f"[distill_vs_rl] {name}: {json.dumps(result)[:400]}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The CPU trainer's padding, before and after micro-batches were padded to their rows instead of seq_len.

Runs `tidal sft @ examples/reverse_text/sft.toml --max-steps N --num-threads 1 --data.seq-len L` (the
demo's SFT: 64 conversations of 77–91 tokens a step, micro_batch_size 64) from two source trees, the old
one (`--before-src`, e.g. a `git worktree add /tmp/padding-base <commit>` of the commit before the change)
and this one, alternately (before, after, before, after, ...) so that both see the same load on a shared
machine, and records each run's median step time (`time/step` of metrics.jsonl, the first `--skip` steps
left out: start-up and first-touch allocations). With `--demo` it also times `python -m tidal.demo` (what
`make demo` runs) once per tree, in that tree (the demo's paths are relative), before first.

The layouts themselves are counted too (pure, from the new code and the old rule): tokens the forward
computes per step, padding included, for the first step's conversations.

    python benchmarks/cpu_padding.py --before-src /tmp/padding-base/src --repeats 2 --demo \\
        --out benchmarks/results/cpu_padding.json
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recipes_cpu import commit, machine

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = "examples/reverse_text/sft.toml"

# ---- pure logic ---------------------------------------------------------------------------------------


def median_step_time(records: Sequence[Mapping[str, Any]], skip: int) -> float:
    """Median `time/step` over the records after the first `skip` steps."""
    times = [r["time/step"] for r in records if "time/step" in r][skip:]
    if not times:
        raise ValueError(f"no step times after the first {skip} steps")
    return statistics.median(times)


def sft_args(steps: int, seq_len: int, output_dir: Path) -> list[str]:
    """The measured command's arguments after `tidal` (held-out eval cut to 8 conversations: not timed)."""
    return [
        "sft", "@", SFT_CONFIG, "--max-steps", str(steps), "--num-threads", "1", "--data.seq-len",
        str(seq_len), "--output-dir", str(output_dir), "--eval.num-examples", "8",
    ]  # fmt: skip


def old_layout_tokens(num_rows: int, micro_batch_size: int, seq_len: int) -> int:
    """Tokens a step computed before: every micro-batch micro_batch_size rows of seq_len (one rank)."""
    num_micro = max(1, -(-num_rows // micro_batch_size))
    return num_micro * micro_batch_size * seq_len


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per seq_len: the median over repeats of each tree's median step time, and after / before."""
    out: dict[str, dict[str, float]] = {}
    for seq_len in sorted({r["seq_len"] for r in runs}):
        medians = {
            tree: statistics.median(
                r["median_step_s"] for r in runs if r["seq_len"] == seq_len and r["tree"] == tree
            )
            for tree in ("before", "after")
        }
        out[str(seq_len)] = {**medians, "after_over_before": round(medians["after"] / medians["before"], 3)}
    return out


# ---- runs -----------------------------------------------------------------------------------------------


def layout_tokens(seq_lens: Sequence[int]) -> dict[str, dict[str, int]]:
    """Real and computed tokens of the first step's batch under both layouts (this tree's code)."""
    from tidal.config.sft import SFTConfig
    from tidal.models.tiny import build_tokenizer
    from tidal.trainer.data import EpochSampler, pack_samples, pad_rows, shard_rows, tokenize_conversation
    from tidal.trainer.sources import load_conversations

    config = SFTConfig.model_validate(tomllib.loads((REPO / SFT_CONFIG).read_text()))
    data = config.data
    tokenizer = build_tokenizer()
    conversations = load_conversations(data.train)
    indices = EpochSampler(len(conversations), config.seed, data.shuffle).next_indices(data.batch_size)
    samples = [tokenize_conversation(tokenizer, conversations[i]) for i in indices]
    out = {}
    for seq_len in seq_lens:
        rows, _ = pack_samples(samples, seq_len)
        micro = [
            pad_rows(m, seq_len, 0, data.pad_multiple) for m in shard_rows(rows, 0, 1, data.micro_batch_size)
        ]
        out[str(seq_len)] = {
            "real": sum(len(s.input_ids) for s in samples),
            "rows": len(rows),
            "before": old_layout_tokens(len(rows), data.micro_batch_size, seq_len),
            "after": sum(len(r) for m in micro for r in m),
        }
    return out


def run_sft(src: Path, tree: Path, steps: int, seq_len: int, skip: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpu_padding_") as tmp:
        out = Path(tmp) / "sft"
        env = {**os.environ, "PYTHONPATH": str(src)}
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "tidal", *sft_args(steps, seq_len, out)],
            cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wall = time.perf_counter() - start
        records = read_jsonl(out / "metrics.jsonl")
    return {"median_step_s": round(median_step_time(records, skip), 4), "wall_s": round(wall, 1)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_demo(src: Path, tree: Path) -> dict[str, Any]:
    """`python -m tidal.demo` in `tree`: wall time, its summary lines, and its trainers' step times (the
    SFT warm-up's `time/step`, the RL trainer's `time/forward_backward`), which the padding changes."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tidal.demo"], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - start
    sft = [r["time/step"] for r in read_jsonl(tree / "outputs/demo/sft/metrics.jsonl") if "time/step" in r]
    rl = [
        r["time/forward_backward"]
        for r in read_jsonl(tree / "outputs/demo/rl/trainer/metrics.jsonl")
        if "time/forward_backward" in r
    ]
    return {
        "wall_s": round(wall, 1),
        "sft_steps_total_s": round(sum(sft), 1),
        "sft_step_median_s": round(statistics.median(sft), 4),
        "rl_trainer_forward_backward_total_s": round(sum(rl), 1),
        "rl_trainer_forward_backward_median_s": round(statistics.median(rl), 4),
        "last_lines": done.stdout.strip().splitlines()[-4:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", type=Path, required=True, help="src/ of the tree before the change")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--demo", action="store_true", help="also time `python -m tidal.demo` in each tree")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/cpu_padding.json")
    args = parser.parse_args()
    trees = {
        "before": (args.before_src.resolve(), args.before_src.resolve().parent),
        "after": (REPO / "src", REPO),
    }
    runs = []
    for repeat in range(args.repeats):
        for seq_len in args.seq_lens:
            for name, (src, tree) in trees.items():
                result = run_sft(src, tree, args.steps, seq_len, args.skip)
                runs.append({"tree": name, "seq_len": seq_len, "repeat": repeat, **result})
                print(json.dumps(runs[-1]), flush=True)
    demo = {name: run_demo(src, tree) for name, (src, tree) in trees.items()} if args.demo else None
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "commit_after": commit(),
        "before_src": str(args.before_src),
        "command": f"tidal sft @ {SFT_CONFIG} --max-steps {args.steps} --num-threads 1 --data.seq-len <seq_len> "
        "--output-dir <tmp> --eval.num-examples 8",
        "benchmark": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "note": "runs alternate before/after per seq_len so both see the same machine load",
        "layout_tokens_first_step": layout_tokens(args.seq_lens),
        "median_step_s": summarise(runs),
        "runs": runs,
        "demo": demo,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["median_step_s"], indent=2))


if __name__ == "__main__":
    main()

"""What RL leaves on held-out tasks: TRL's GRPOTrainer, tidal synchronous and tidal one step async, each the
same number of steps from the same warm-up, then `tidal eval` of every final model on reverse_text's held-out
split, greedy (k = 1) and sampled (T = 1, k = 8).

The runs are benchmarks/cpu_vs_trl.py's (same tasks in the same order, same reward, same hyper-parameters
from examples/reverse_text/rl.toml); that benchmark times them, this one scores what they trained. The
question it answers: does tidal's RL generalise as TRL's does, and what does `max_async_level` cost there?

    flock /tmp/tidal-heavy.lock .venv/bin/python benchmarks/heldout_after_rl.py --trl-site /work/trl-site \\
        --workdir /tmp/heldout --out benchmarks/results/heldout_after_rl_cpu.json
"""

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from cpu_vs_trl import (
    REPO,
    RL_CONFIG,
    check_loss_matches,
    commit,
    first_last,
    run_tidal,
    run_trl,
    task_from_rl_config,
    versions,
    warm_up,
)
from recipes_cpu import machine

HELDOUT_ENV = '[{name = "reverse_text", kwargs = {split = "heldout", num_examples = 100}}]'
# (name, k, temperature): the greedy answer and eight samples per held-out task
SAMPLINGS = (("greedy", 1, 0.0), ("sampled", 8, 1.0))


def evaluate(
    model: str, out_dir: Path, k: int, temperature: float, lengths: tuple[int, int], port: int
) -> dict:
    """`tidal eval` of `model` on the held-out split; its avg@k and pass@1 with their 95% intervals.
    `lengths`: rl.toml's (max new tokens, max model length), as the runs sampled."""
    max_tokens, max_model_len = lengths
    argv = [
        sys.executable, "-m", "tidal", "eval", "--model.name", model, "--model.dtype", "float32",
        "--output-dir", str(out_dir), "--env", HELDOUT_ENV, "--num-tasks", "100", "--k", str(k),
        "--sampling.temperature", str(temperature), "--sampling.max-tokens", str(max_tokens),
        "--inference.vllm.max-model-len", str(max_model_len), "--inference.vllm.enforce-eager",
        "--inference.server.port", str(port),
    ]  # fmt: skip
    print("$", shlex.join(argv[1:]), flush=True)
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"heldout_after_rl: tidal eval of {model} failed:\n{done.stdout[-2000:]}")
    scores = json.loads((out_dir / "eval.json").read_text())["envs"]["reverse_text"]
    return {
        "command": "tidal " + shlex.join(argv[3:]),
        f"avg@{k}": scores[f"avg@{k}"],
        "pass@1": scores["pass@1"],
    }


def evaluate_all(model: str, out_dir: Path, lengths: tuple[int, int], port: int) -> dict[str, Any]:
    return {
        name: evaluate(model, out_dir / name, k, temperature, lengths, port)
        for name, k, temperature in SAMPLINGS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trl-site", type=Path, required=True, help="the folder trl was installed into")
    parser.add_argument("--warmup", help="an SFT warm-up's final/ to reuse instead of running the SFT")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=60, help="RL steps on every side")
    parser.add_argument("--port", type=int, default=18650)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    args = parser.parse_args()

    rl = tomllib.loads((REPO / RL_CONFIG).read_text())
    check_loss_matches(rl)
    lengths = (
        int(rl["orchestrator"]["sampling"]["max_tokens"]),
        int(rl["inference"]["vllm"]["max_model_len"]),
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results: dict[str, Any] = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": "flock /tmp/tidal-heavy.lock python "
        + shlex.join(["benchmarks/heldout_after_rl.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": commit(),
        "versions": versions(args.trl_site),
        "definitions": {
            "greedy": "avg@1 and pass@1 (exact reversal) of the greedy answer on 100 held-out tasks",
            "sampled": "avg@8 and pass@1 of 8 samples at T = 1 on the same tasks",
            "train_reward_first_last_10": "the run's own sampled reward on its training tasks, first and last "
            "10 steps",
        },
        "runs": [],
    }
    results["warmup"] = warm_up(args.warmup, args.workdir, args.timeout)
    warmup = results["warmup"]["final_dir"]
    results["warmup"]["heldout"] = evaluate_all(warmup, args.workdir / "eval_warmup", lengths, args.port)
    print(json.dumps({"warmup": results["warmup"]["heldout"]}), flush=True)
    for seed in args.seeds:
        task = task_from_rl_config(rl, seed, args.steps)
        entry: dict[str, Any] = {"seed": seed, "steps": args.steps}
        trl_final = args.workdir / f"seed{seed}" / "trl_final"
        trl = run_trl(task, warmup, args.workdir, args.trl_site, args.timeout, save=trl_final)
        entry["trl"] = {"rewards": trl["rewards"], "command": trl["command"]}
        finals = {"trl": str(trl_final)}
        for name, level in (("tidal_async1", 1), ("tidal_async0", 0)):
            side = run_tidal(
                task,
                rl,
                warmup,
                args.workdir / name,
                args.port,
                False,
                args.timeout,
                {"max_async_level": level},
            )
            entry[name] = {"rewards": side["rewards"], "command": side["command"], "max_async_level": level}
            finals[name] = str(
                args.workdir / name / f"seed{seed}" / "tidal" / "out" / "weights" / f"step_{args.steps}"
            )
        for name, final in finals.items():
            entry[name]["train_reward_first_last_10"] = list(first_last(entry[name]["rewards"]))
            entry[name]["model"] = final
            entry[name]["heldout"] = evaluate_all(
                final, args.workdir / f"seed{seed}" / f"eval_{name}", lengths, args.port
            )
            print(
                json.dumps({"seed": seed, name: {k: v for k, v in entry[name].items() if k != "rewards"}}),
                flush=True,
            )
        results["runs"].append(entry)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    results["benchmark_wall_s"] = round(time.time() - start, 1)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

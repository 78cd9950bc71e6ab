"""The one-GPU recipes of the examples: `tidal sft` then `tidal rl`, for several environments on one GPU at once.

For each environment named, runs what its README tells a user with one GPU to run
(examples/<env>/sft_one_gpu.toml, then examples/<env>/rl_one_gpu.toml from the SFT's final/) and records
the same summary as benchmarks/recipes_cpu.py: SFT loss and held-out greedy exact match; RL sampled reward
per 10 steps and the online eval (greedy reward on held-out tasks) before the first update and after.

Several environments share the GPU: every SFT runs at once (`--phase sft`), then the RL runs start one
after another (`--phase rl`), each once the one before has its vLLM server answering /health. vLLM sizes its
KV cache from the device's free memory while it starts, and fails if another process frees GPU memory
during that window; staggered starts after every SFT has exited keep that from happening.

With `--sft-steps ENV=N1,N2` the warm-ups of those lengths run side by side and RL starts from the one whose
held-out greedy exact match is nearest `--target`: too little SFT leaves RL no rewarded rollouts to learn from,
too much leaves it nothing to improve. `--phase all` (or `select`) chooses better: it runs `tidal eval` on
each warm-up as RL samples it (the RL config's environment, temperature and lengths, `--select-k` samples per
task) and starts RL from the warm-up with the most tasks whose samples' rewards differ; the last-turn match
says little about multi-turn episodes (tool_use: 0.47 last turn, 0.01 whole episodes). Ten warm-ups
evaluated at once (ten vLLM servers starting together on a 16-core H200 machine) had not finished 64 tasks × 8
samples in 110 s: give the selection ~200 s there.

`--deadline` counts from this script's start: on a device call, subtract what ran before it (unpacking vLLM),
e.g. `--deadline $((570 - SECONDS))` in the call's shell.

    python benchmarks/recipes_gpu.py alphabet_sort math --phase both --workdir /root/recipes \
        --out /root/out/recipes_gpu.json --deadline 560 --sft-steps alphabet_sort=200,350 math=250,400
"""

import argparse
import json
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Mapping, Sequence
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


def sft_dir(env: str, workdir: Path, steps: int | None) -> Path:
    return workdir / env / ("sft" if steps is None else f"sft_{steps}")


def sft_command(env: str, workdir: Path, steps: int | None) -> list[str]:
    """The README's SFT command; `steps` overrides the config's max_steps (a shorter or longer warm-up)."""
    args = ["sft", "@", f"examples/{env}/sft_one_gpu.toml", "--output-dir", str(sft_dir(env, workdir, steps))]
    return args if steps is None else [*args, "--max-steps", str(steps)]


def rl_command(
    env: str, workdir: Path, start: Path, lr: str | None = None, variant: int = 0, extra: Sequence[str] = ()
) -> list[str]:
    """The README's RL command from the warm-up `start`; `lr` runs variant number `variant` at another
    learning rate (own output directory and port, so variants run side by side)."""
    args = ["rl", "@", f"examples/{env}/rl_one_gpu.toml", "--model.name", str(start / "final"),
            "--output-dir", str(rl_dir(env, workdir, lr)), *extra]  # fmt: skip
    if lr is None:
        return args
    return [*args, "--trainer.optim.lr", lr, "--inference.server.port", str(rl_port(env, variant))]


def rl_dir(env: str, workdir: Path, lr: str | None) -> Path:
    return workdir / env / ("rl" if lr is None else f"rl_lr{lr}")


def pick_warm_up(variants: dict[int | None, dict[str, Any]], target: float) -> int | None:
    """The warm-up RL starts from: held-out greedy exact match nearest `target` (fewer steps on a tie). Too
    little SFT leaves most groups without one rewarded rollout (nothing to learn from); too much leaves
    nothing to improve."""
    scored = [
        (abs(v["heldout_exact_match_last_turn"] - target), steps or 0, steps)
        for steps, v in variants.items()
        if v.get("exit_code") == 0 and v.get("heldout_exact_match_last_turn") is not None
    ]
    return min(scored)[2] if scored else None


def start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tidal", *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT
        )


def stop_at(deadline: float, processes: Sequence[subprocess.Popen]) -> set[int]:
    """Wait until every process has exited or the absolute `deadline` (time.monotonic) has passed, then
    SIGTERM every one still running, all at once: a stopped run stops every process it started and keeps
    what it wrote, which takes seconds per run, and stopping ten runs one after another overran a device
    call. Returns the pids it stopped."""
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(1.0)
    stopped = {p.pid for p in processes if p.poll() is None}
    for process in processes:
        if process.pid in stopped:
            process.terminate()
    return stopped


def finish(process: subprocess.Popen, started: float, stopped: set[int]) -> dict[str, Any]:
    """The exit of a process that has ended or was sent SIGTERM by `stop_at`."""
    code = process.wait()
    return {
        "exit_code": code,
        "timed_out": process.pid in stopped,
        "wall_s": round(time.monotonic() - started, 1),
    }


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def rl_port(env: str, variant: int | None = None) -> int:
    """The config's port; learning-rate variant i takes the config's + 1 + i (the examples' ports are 10
    apart; the selection's evals take + 5 on)."""
    base = int(rl_settings(env)["inference"]["server"]["port"])
    return base if variant is None else base + 1 + variant


def run_sfts(
    envs: list[str], workdir: Path, steps: dict[str, list[int]], deadline: float
) -> dict[str, dict[int | None, dict[str, Any]]]:
    running = {}
    for env in envs:
        lengths: list[int | None] = [*steps[env]] if steps.get(env) else [None]
        for n in lengths:
            sft_dir(env, workdir, n).parent.mkdir(parents=True, exist_ok=True)
            log = workdir / env / f"{sft_dir(env, workdir, n).name}.log"
            running[env, n] = (start(sft_command(env, workdir, n), log), time.monotonic())
    results: dict[str, dict[int | None, dict[str, Any]]] = {}
    stopped = stop_at(deadline, [process for process, _ in running.values()])
    for (env, n), (process, started) in running.items():
        ran = finish(process, started, stopped)
        summary = {**ran, **sft_summary(read_jsonl(sft_dir(env, workdir, n) / "metrics.jsonl"))}
        results.setdefault(env, {})[n] = summary
        print(f"[recipes] {env} sft ({n or 'config'} steps): {summary}", flush=True)
    return results


def mark_warm_up(env: str, workdir: Path, steps: int | None) -> None:
    """Record which SFT run the RL phase starts from (read by `chosen_warm_up`, also in a later call)."""
    (workdir / env / "warm_up").write_text(sft_dir(env, workdir, steps).name)


def chosen_warm_up(env: str, workdir: Path) -> Path:
    """The SFT run the RL phase starts from (written by the SFT phase; `sft/` when there is no choice)."""
    marker = workdir / env / "warm_up"
    return workdir / env / marker.read_text().strip() if marker.exists() else sft_dir(env, workdir, None)


def run_rls(
    envs: list[str],
    workdir: Path,
    deadline: float,
    health_timeout: float,
    lrs: Sequence[str | None],
    extra: Sequence[str],
    on_result: Callable[[str, str | None, dict[str, Any]], None],
) -> None:
    """Start every RL run (staggered by `health_timeout`), then collect each; `on_result` gets each summary
    as it comes, so a call cut short keeps the runs already collected."""
    running = {}
    for env in envs:
        warm_up = chosen_warm_up(env, workdir)
        if not (warm_up / "final" / "config.json").exists():
            print(f"[recipes] {env}: no SFT {warm_up}/final, RL skipped", flush=True)
            continue
        for variant, lr in enumerate(lrs):
            command = rl_command(env, workdir, warm_up, lr, variant, extra)
            log = workdir / env / f"{rl_dir(env, workdir, lr).name}.log"
            process, started = start(command, log), time.monotonic()
            running[env, lr] = (process, started, command)
            port = rl_port(env, None if lr is None else variant)
            waited_until = min(deadline, time.monotonic() + health_timeout)
            while time.monotonic() < waited_until and process.poll() is None and not healthy(port):
                time.sleep(1.0)
            print(
                f"[recipes] {env} rl (lr {lr or 'config'}): server up after {time.monotonic() - started:.0f} s"
            )
    stopped = stop_at(deadline, [process for process, _, _ in running.values()])
    for (env, lr), (process, started, command) in running.items():
        ran = finish(process, started, stopped)
        records = read_jsonl(rl_dir(env, workdir, lr) / "orchestrator" / "metrics.jsonl")
        summary = {"command": "tidal " + " ".join(command), **ran, **rl_summary(env, records)}
        print(f"[recipes] {env} rl (lr {lr or 'config'}): {summary}", flush=True)
        on_result(env, lr, summary)


# ---- choosing the warm-up by what RL will see ----------------------------------------------------------


def rl_settings(env: str) -> dict[str, Any]:
    return tomllib.loads((REPO / "examples" / env / "rl_one_gpu.toml").read_text())


def inline_table(values: dict[str, Any]) -> str:
    """A TOML inline table of plain values (JSON writes strings, numbers and booleans as TOML does)."""
    return "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in values.items()) + "}"


def eval_command(env: str, workdir: Path, steps: int | None, index: int, k: int, num_tasks: int) -> list[str]:
    """`tidal eval` of a warm-up as RL samples it: the RL config's environment, temperature and lengths,
    k samples per task; its own port (the RL port + 5 + index) and a fixed KV cache so several start at once."""
    rl = rl_settings(env)
    spec = rl["orchestrator"]["env"][0]
    table = inline_table({"name": spec["name"]}) if not spec.get("kwargs") else (
        "{name = " + json.dumps(spec["name"]) + ", kwargs = " + inline_table(spec["kwargs"]) + "}"
    )  # fmt: skip
    sampling, vllm = rl["orchestrator"]["sampling"], rl["inference"]["vllm"]
    args = [
        "eval", "--model.name", str(sft_dir(env, workdir, steps) / "final"),
        "--output-dir", str(workdir / env / f"select_{steps}"), "--env", f"[{table}]",
        "--num-tasks", str(num_tasks), "--k", str(k),
        "--sampling.temperature", str(sampling.get("temperature", 1.0)),
        "--sampling.max-tokens", str(sampling["max_tokens"]),
        "--inference.vllm.max-model-len", str(vllm["max_model_len"]), "--inference.vllm.enforce-eager",
        "--inference.vllm.gpu-memory-utilization", "0.05",
        "--inference.vllm.extra-args", '["--kv-cache-memory-bytes", "2G"]',
        "--inference.server.port", str(int(rl["inference"]["server"]["port"]) + 5 + index),
    ]  # fmt: skip
    if "dtype" in rl.get("model", {}):
        args += ["--model.dtype", rl["model"]["dtype"]]
    return args


def group_signal(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """From rollouts.jsonl: the mean reward, and the share of tasks whose samples' rewards differ (a group
    RL can learn from; the others it drops as zero-signal)."""
    by_task: dict[str, list[float]] = {}
    for record in records:
        by_task.setdefault(record["task_id"], []).append(float(record.get("reward", 0.0)))
    rewards = [r for task in by_task.values() for r in task]
    differ = [len(set(task)) > 1 for task in by_task.values()]
    return {
        "tasks": float(len(by_task)),
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "signal_fraction": sum(differ) / len(differ) if differ else 0.0,
    }


def select_by_eval(
    envs: list[str], workdir: Path, steps: dict[str, list[int]], deadline: float, k: int, num_tasks: int
) -> dict[str, dict[str, Any]]:
    """Every warm-up evaluated at once as RL would sample it; each environment's RL starts from the one with
    the most groups that differ (ties: the shorter warm-up)."""
    running = {}
    for env in envs:
        for index, n in enumerate(steps.get(env) or [None]):
            command = eval_command(env, workdir, n, index, k, num_tasks)
            log = workdir / env / f"select_{n}.log"
            running[env, n] = (start(command, log), time.monotonic(), command)
    candidates: dict[str, dict[int | None, dict[str, Any]]] = {}
    stopped = stop_at(deadline, [process for process, _, _ in running.values()])
    for (env, n), (process, started, command) in running.items():
        ran = finish(process, started, stopped)
        signal = group_signal(read_jsonl(workdir / env / f"select_{n}" / "rollouts.jsonl"))
        summary = {"command": "tidal " + " ".join(command), **ran, **signal}
        print(f"[recipes] {env} select ({n} steps): {summary}", flush=True)
        candidates.setdefault(env, {})[n] = summary
    chosen: dict[str, dict[str, Any]] = {}
    for env, by_steps in candidates.items():
        entry: dict[str, Any] = {"candidates": {str(n): v for n, v in by_steps.items()}}
        scored = [
            (-v["signal_fraction"], n or 0, n)
            for n, v in by_steps.items()
            if v["exit_code"] == 0 and v["tasks"] > 0
        ]
        if scored:
            best = min(scored)[2]
            entry["chosen_steps"] = str(best)
            mark_warm_up(env, workdir, best)
        chosen[env] = entry
    return chosen


def parse_steps(items: list[str]) -> dict[str, list[int]]:
    """`ENV=N1,N2` → {ENV: [N1, N2]}: SFT warm-ups of these lengths, run side by side."""
    steps = {}
    for item in items:
        env, _, values = item.partition("=")
        steps[env] = [int(v) for v in values.split(",") if v]
    return steps


def pack_raw(envs: list[str], workdir: Path, raw: Path) -> None:
    """Every run's metrics and logs in one tar.gz, for reading the runs afterwards (one small file: the
    device tool brings back few files and shallow folders)."""
    with tarfile.open(raw, "w:gz") as tar:
        for env in envs:
            for path in [*(workdir / env).glob("**/metrics.jsonl"), *(workdir / env).glob("*.log")]:
                tar.add(path, arcname=str(path.relative_to(workdir)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("envs", nargs="+")
    parser.add_argument("--workdir", type=Path, required=True, help="run directories go under it")
    parser.add_argument(
        "--out", type=Path, required=True, help="results JSON (entries merged by environment)"
    )
    parser.add_argument(
        "--phase", choices=["sft", "select", "rl", "both", "all"], default="both",
        help="both: sft then rl; select: evaluate each warm-up as RL samples it and start RL from the one with "
        "the most groups that differ; all: sft, select, rl",
    )  # fmt: skip
    parser.add_argument("--select-k", type=int, default=8, help="select: samples per task (RL's group size)")
    parser.add_argument("--select-tasks", type=int, default=64, help="select: tasks per warm-up")
    parser.add_argument(
        "--select-share", type=float, default=0.2, help="with --phase all: the selection's share of the time"
    )
    parser.add_argument(
        "--deadline", type=float, default=540, help="seconds from now when every run is stopped"
    )
    parser.add_argument(
        "--sft-share", type=float, default=0.45, help="with --phase both: SFT's share of the time"
    )
    parser.add_argument(
        "--health-timeout", type=float, default=180, help="seconds to wait for each RL server"
    )
    parser.add_argument(
        "--sft-steps", nargs="*", default=[], metavar="ENV=N1,N2",
        help="SFT warm-ups of these lengths side by side; RL starts from the one nearest --target",
    )  # fmt: skip
    parser.add_argument(
        "--target", type=float, default=0.4, help="held-out exact match the chosen warm-up is nearest"
    )
    parser.add_argument(
        "--rl-lr", default="", help="comma-separated learning rates: an RL run per rate and environment"
    )
    parser.add_argument(
        "--rl-arg", action="append", default=[], help="appended to every RL command (repeat it)"
    )
    parser.add_argument("--raw", type=Path, help="a tar.gz of every run's metrics and logs")
    args = parser.parse_args()
    t0 = time.monotonic()
    end = t0 + args.deadline
    steps = parse_steps(args.sft_steps)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for env in args.envs:
        entry = results.setdefault(env, {})
        entry.update({"machine": f"{gpu_name()}, {machine()}", "commit": commit()})
    if args.phase in ("sft", "both", "all"):
        sft_end = t0 + args.deadline * args.sft_share if args.phase in ("both", "all") else end
        for env, variants in run_sfts(args.envs, args.workdir, steps, sft_end).items():
            chosen = pick_warm_up(variants, args.target) if len(variants) > 1 else next(iter(variants))
            mark_warm_up(env, args.workdir, chosen)
            entry = results[env]
            entry["sft_command"] = "tidal " + " ".join(sft_command(env, args.workdir, chosen))
            entry["sft"] = {"max_steps": chosen, **variants[chosen]}
            if len(variants) > 1:
                entry["sft_variants"] = {str(n): v for n, v in variants.items()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.phase in ("select", "all"):
        select_end = time.monotonic() + args.deadline * args.select_share if args.phase == "all" else end
        for env, entry in select_by_eval(
            args.envs, args.workdir, steps, select_end, args.select_k, args.select_tasks
        ).items():
            results[env]["selection"] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.phase in ("rl", "both", "all"):
        lrs: list[str | None] = [v for v in args.rl_lr.split(",") if v] or [None]

        def keep(env: str, lr: str | None, summary: dict[str, Any]) -> None:
            if lr is None:
                results[env]["rl"] = summary
            else:
                results[env].setdefault("rl_variants", {})[f"lr {lr}"] = summary
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            if args.raw:  # also after each run: a call cut short still brings back what finished
                pack_raw(args.envs, args.workdir, args.raw)

        args.out.parent.mkdir(parents=True, exist_ok=True)
        run_rls(args.envs, args.workdir, end, args.health_timeout, lrs, args.rl_arg, keep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.raw:
        pack_raw(args.envs, args.workdir, args.raw)


if __name__ == "__main__":
    main()

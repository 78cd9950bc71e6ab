"""RL that raises a real pretrained model's held-out score, one GPU: every recipe of one model side by side.

A recipe is `examples/<env>/rl_<model>.toml`, with `examples/<env>/sft_<model>.toml` before it where the
environment's demonstrations warm the model up first (where the base model scores near 0). For each:

    [tidal sft @ sft_<model>.toml  → warm-up; tidal eval of the base model on the held-out tasks]
    tidal rl @ rl_<model>.toml --model.name <base or warm-up>  (online eval at step 0, every interval, final)

The held-out score before RL is the RL run's own step-0 online eval (its policy is the base model or the
warm-up); after RL it is the final eval (the last one, if the deadline stopped the run first). A recipe with
a warm-up also gets the base model's score from `tidal eval` on the same held-out tasks with the same
sampling (the online eval's environment spec, read from `tidal rl --dry-run`). Each score is the greedy
avg@1 over the environment's held-out split with its 95% interval.

Every run shares the GPU: the RL runs start together, each vLLM server with a fixed KV cache
(`--kv-cache-memory-bytes`: no start-up profiling of free memory, which other processes starting at the same
time would upset) and its config's own port. The results file is rewritten as each recipe ends, so a call cut
short keeps what finished; `--raw` packs every run's metrics, evals and logs into one tar.gz.

    python benchmarks/real_models.py --model /root/models/SmolLM2-135M-Instruct.Q4_1.gguf --suffix smollm2 \\
        --envs math alphabet_sort tool_use --workdir /root/rm --out /root/out/real_models_h200.json \\
        --deadline 1000 --raw /root/out/real_models_raw.tar.gz
"""

import argparse
import json
import subprocess
import sys
import tarfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SHARED_GPU_FLAGS = [
    "--inference.vllm.gpu-memory-utilization", "0.05",
    "--inference.vllm.extra-args", '["--kv-cache-memory-bytes", "4G"]',
]  # fmt: skip
"""Added to every RL and eval run here so that several share one GPU (not part of the recipes; `--cpu`: none)."""
EXTRA: list[str] = []
"""What this run adds to every RL and eval command: SHARED_GPU_FLAGS, unless `--cpu`."""


def recipe_files(env: str, suffix: str, variant: str = "") -> tuple[Path | None, Path]:
    """The recipe's (warm-up, RL) configs; a variant is `rl_<suffix>_<variant>.toml` (and its own warm-up if
    `sft_<suffix>_<variant>.toml` exists)."""
    name = f"{suffix}_{variant}" if variant else suffix
    sft = EXAMPLES / env / f"sft_{name}.toml"
    return (sft if sft.exists() else None), EXAMPLES / env / f"rl_{name}.toml"


STARTED: list[subprocess.Popen] = []
"""Every run this script started: stopped when it ends, however it ends."""


def tidal(args: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "tidal", *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT
        )
    STARTED.append(process)
    return process


def stop_started() -> None:
    """SIGTERM what is still running, all at once (each stops every process it started), then wait."""
    alive = [p for p in STARTED if p.poll() is None]
    for process in alive:
        process.terminate()
    for process in alive:
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def wait(process: subprocess.Popen, deadline: float) -> tuple[int | None, bool]:
    """(exit code, stopped by the deadline): SIGTERM at the deadline, which keeps what the run wrote."""
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(2.0)
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout=120), True
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(), True
    return process.returncode, False


def port_of(config: Path) -> int:
    return int(tomllib.loads(config.read_text())["inference"]["server"]["port"])


def heldout_eval_args(rl_config: Path, model: str, out: Path, port: int) -> list[str]:
    """`tidal eval` of `model` on exactly the RL run's online-eval tasks and sampling (from its dry run)."""
    shown = subprocess.run(
        [sys.executable, "-m", "tidal", "rl", "@", str(rl_config), "--model.name", model, "--dry-run"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    orchestrator = shown.split("configs/orchestrator.toml ----\n", 1)[1].split("\n# ----", 1)[0]
    spec = tomllib.loads(orchestrator)["online_eval"]
    eval_config = out.parent / "heldout_eval.toml"
    eval_config.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"num_tasks = {spec['num_tasks']}", "k = 1", "", "[sampling]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in spec["sampling"].items()]
    from tidal.envs import bwrap

    bwrap_problem = bwrap.probe()
    for env in spec["env"]:
        lines += ["", "[[env]]", f"name = {json.dumps(env['name'])}"]
        found = without_bwrap(env.get("kwargs", {}), bwrap_problem)
        kwargs = ", ".join(f"{k} = {json.dumps(v)}" for k, v in found.items())
        lines.append(f"kwargs = {{{kwargs}}}")
    eval_config.write_text("\n".join(lines) + "\n")
    settings = tomllib.loads(rl_config.read_text())
    vllm = settings.get("inference", {}).get("vllm", {})
    args = ["eval", "@", str(eval_config), "--model.name", model, "--output-dir", str(out),
            "--inference.server.port", str(port)]  # fmt: skip
    # the RL run's own share of a GPU it may share (tidal eval's default would take 0.92 of it), unless
    # EXTRA sets that flag itself (one value per flag in the command that is reported)
    if "gpu_memory_utilization" in vllm and "--inference.vllm.gpu-memory-utilization" not in EXTRA:
        args += ["--inference.vllm.gpu-memory-utilization", str(vllm["gpu_memory_utilization"])]
    if vllm.get("extra_args") and "--inference.vllm.extra-args" not in EXTRA:
        args += ["--inference.vllm.extra-args", json.dumps(vllm["extra_args"])]
    args += EXTRA
    if "max_model_len" in vllm:
        args += ["--inference.vllm.max-model-len", str(vllm["max_model_len"])]
    if "dtype" in settings.get("model", {}):
        args += ["--model.dtype", settings["model"]["dtype"]]
    return args


def without_bwrap(kwargs: dict[str, Any], bwrap_problem: str | None) -> dict[str, Any]:
    """An environment's kwargs with `sandbox = "process"` where they ask for bwrap and bwrap cannot run here
    (`bwrap_problem`: `bwrap.probe()`'s reason, None where it runs): the RL run's recipe
    (`Recipe.sandbox_fallback`) and the base model's eval beside it run where the other runs."""
    if kwargs.get("sandbox") != "bwrap" or bwrap_problem is None:
        return kwargs
    return {**kwargs, "sandbox": "process"}


def toml_inline(value: Any) -> str:
    """A value as a TOML inline literal (a command-line override's value), for str/bool/number/list/dict."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_inline(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_inline(item) for item in value) + "]"
    return json.dumps(value)  # a JSON string, bool or number is also a TOML one


def score(report: dict[str, Any]) -> dict[str, Any]:
    """An environment's greedy avg@1 as the results file writes it: mean, 95% interval, number of tasks."""
    estimate = report["avg@1"]
    return {
        "mean": round(estimate["mean"], 4),
        "ci95": [round(estimate["ci_low"], 4), round(estimate["ci_high"], 4)],
        "n": report["num_tasks"],
    }


def online_evals(rl_dir: Path) -> list[dict[str, Any]]:
    path = rl_dir / "orchestrator" / "online_eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def env_report(record: dict[str, Any], env: str) -> dict[str, Any] | None:
    """The record's report of `env` (its label may carry a suffix), None when it failed or is missing."""
    for name, report in record["envs"].items():
        if name.split("/")[0] == env and "avg@1" in report:
            return report
    return None


class Recipe:
    """One environment's runs: the optional warm-up and base eval, then RL; `result()` is its entry.

    `spec` is `env`, `env:variant` for the recipe variant `rl_<suffix>_<variant>.toml` (its own port), then
    optionally `+steps` for a warm-up of that many SFT steps, and `@lr` for another RL learning rate (each its
    own directory, and ports 2 above those of the same config's recipe before it, so it runs beside it)."""

    def __init__(
        self, spec: str, suffix: str, model: str, workdir: Path, max_steps: int | None = None,
        eval_interval: int | None = None, samples_interval: int | None = None,
    ):  # fmt: skip
        recipe, _, self.lr = spec.partition("@")
        recipe, _, self.warmup_steps = recipe.partition("+")
        self.env, _, variant = recipe.partition(":")
        self.model = model
        self.max_steps = max_steps
        self.eval_interval, self.samples_interval = eval_interval, samples_interval
        self.sft_config, self.rl_config = recipe_files(self.env, suffix, variant)
        if self.warmup_steps and self.sft_config is None:
            raise SystemExit(f"real_models: {spec}: +{self.warmup_steps} names a warm-up this recipe has not")
        name = "_".join(
            [self.env]
            + ([variant] if variant else [])
            + ([f"w{self.warmup_steps}"] if self.warmup_steps else [])
            + ([f"lr{self.lr}"] if self.lr else [])
        )
        self.dir = workdir / name
        self.port = port_of(self.rl_config)  # run() moves it 2 up per earlier recipe of the same config
        self.commands: list[str] = []
        self.notes: dict[str, Any] = {}
        self.base_eval: dict[str, Any] | None = None
        self.rl_started = self.rl_ended = 0.0

    def sft_args(self) -> list[str]:
        """The warm-up's `tidal sft` arguments (its config's steps, or the spec's `+STEPS`)."""
        assert self.sft_config is not None
        args = [
            "sft",
            "@",
            str(self.sft_config),
            "--model.name",
            self.model,
            "--output-dir",
            str(self.dir / "sft"),
        ]
        return args + (["--max-steps", self.warmup_steps] if self.warmup_steps else [])

    def warm_up(self, deadline: float) -> str | None:
        """The warm-up's final/ (None without one, or when it failed), with the base eval beside it."""
        if self.sft_config is None:
            return self.model
        sft_args = self.sft_args()
        eval_args = heldout_eval_args(self.rl_config, self.model, self.dir / "base_eval", self.port + 5)
        self.commands += ["tidal " + " ".join(sft_args), "tidal " + " ".join(eval_args)]
        sft, base = tidal(sft_args, self.dir / "sft.log"), tidal(eval_args, self.dir / "base_eval.log")
        sft_code, _ = wait(sft, deadline)
        base_code, _ = wait(base, deadline)
        self.notes.update(sft_exit=sft_code, base_eval_exit=base_code)
        report = self.dir / "base_eval" / "eval.json"
        if base_code == 0 and report.exists():
            self.base_eval = env_report(json.loads(report.read_text()), self.env)
        final = self.dir / "sft" / "final"
        return str(final) if sft_code == 0 and (final / "config.json").exists() else None

    def rl_args(self, start: str) -> list[str]:
        """The RL run's `tidal` arguments from `start` (the base model, or the warm-up's final/)."""
        args = ["rl", "@", str(self.rl_config), "--model.name", start, "--output-dir", str(self.dir / "rl"),
                "--inference.server.port", str(self.port), *EXTRA]  # fmt: skip
        if self.lr:
            args += ["--trainer.optim.lr", self.lr]
        if self.max_steps:
            args += ["--max-steps", str(self.max_steps)]
        if self.eval_interval:
            args += ["--orchestrator.online-eval.interval", str(self.eval_interval)]
        if self.samples_interval:
            args += ["--orchestrator.samples.interval", str(self.samples_interval)]
        return args + self.sandbox_fallback()

    def check(self) -> None:
        """The RL run's `tidal rl --dry-run` (from the base model) before anything starts: a config error,
        such as `--max-steps` below the recipe's scheduler warm-up, stops the script at once instead of after
        the warm-up (on 2026-12-06 it cost a GPU call's RL half)."""
        shown = subprocess.run(
            [sys.executable, "-m", "tidal", *self.rl_args(self.model), "--dry-run"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        if shown.returncode != 0:
            lines = shown.stderr.strip().splitlines() or ["tidal rl --dry-run failed"]
            raise SystemExit(f"real_models: {self.dir.name}: {lines[-1]}")

    def start_rl(self, start: str) -> subprocess.Popen:
        args = self.rl_args(start)
        self.commands.append("tidal " + " ".join(args))
        self.rl_started = time.monotonic()
        return tidal(args, self.dir / "rl.log")

    def sandbox_fallback(self) -> list[str]:
        """The recipe's environments with `sandbox = "process"` where it asks for bwrap and bwrap cannot run
        here (the GPU machine's image has no bubblewrap): the model's code then runs in its own process group
        under rlimits only, on a machine that is thrown away after the call. Recorded in the run's notes."""
        envs = tomllib.loads(self.rl_config.read_text()).get("orchestrator", {}).get("env", [])
        if not any(env.get("kwargs", {}).get("sandbox") == "bwrap" for env in envs):
            return []
        from tidal.envs import bwrap

        problem = bwrap.probe()
        if problem is None:
            return []
        self.notes["sandbox"] = f"process, not the recipe's bwrap: {problem}"
        for env in envs:
            if "kwargs" in env:
                env["kwargs"] = without_bwrap(env["kwargs"], problem)
        return ["--orchestrator.env", toml_inline(envs)]

    def result(self, code: int | None, stopped: bool) -> dict[str, Any]:
        self.rl_ended = time.monotonic()
        evals = [e for e in online_evals(self.dir / "rl") if env_report(e, self.env) is not None]
        first, last = (evals[0], evals[-1]) if evals else (None, None)
        before = score(env_report(first, self.env)) if first else None  # type: ignore[arg-type]
        after = score(env_report(last, self.env)) if last and last is not first else None  # type: ignore[arg-type]
        trained = self.dir / "rl" / "trainer" / "metrics.jsonl"
        steps = len(trained.read_text().splitlines()) if trained.exists() else 0
        warm = self.sft_config is not None
        base = score(self.base_eval) if warm and self.base_eval else (None if warm else before)
        return {
            "env": self.env,
            "recipe": self.rl_config.name,
            "rl_lr": self.lr or "the recipe's",
            "model": Path(self.model).name,
            "heldout_base": base,
            "heldout_warmup": before if warm else None,
            "heldout_after_rl": after,
            "after_rl_eval": {"step": last["step"], "final": last["final"]} if last else None,
            "rl_steps": steps,
            "rl_wall_s": round(self.rl_ended - self.rl_started, 1),
            "rl_exit_code": code,
            "stopped_by_deadline": stopped,
            **self.notes,
            "commands": self.commands,
        }


def assign_ports(recipes: list["Recipe"]) -> None:
    """Each recipe its own server port (and eval port, 5 above): 2 above the last recipe of the same config, so
    lr variants of one recipe run side by side (two of them on one port cost a GPU round, 2026-12-05)."""
    for index, recipe in enumerate(recipes):
        recipe.port = port_of(recipe.rl_config) + 2 * sum(
            other.rl_config == recipe.rl_config for other in recipes[:index]
        )


def goal_met(run: dict[str, Any]) -> bool:
    """A rise of ≥ 0.10 in the held-out greedy reward over RL's starting point, intervals apart."""
    before = run["heldout_warmup"] or run["heldout_base"]
    after = run["heldout_after_rl"]
    if not before or not after:
        return False
    return after["mean"] - before["mean"] >= 0.10 and after["ci95"][0] > before["ci95"][1]


def write(out: Path, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    for run in runs:
        run["goal_met"] = goal_met(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")


def pack(workdir: Path, raw: Path) -> None:
    """Metrics, online evals, eval reports and logs of every run in one tar.gz (the device tool brings back
    few files)."""
    patterns = ["*/*.log", "*/rl/*/metrics.jsonl", "*/rl/orchestrator/online_eval.jsonl", "*/rl/logs/*.log",
                "*/sft/metrics.jsonl", "*/base_eval/eval.json", "*/rl/samples.jsonl"]  # fmt: skip
    with tarfile.open(raw, "w:gz") as tar:
        for pattern in patterns:
            for path in sorted(workdir.glob(pattern)):
                tar.add(path, arcname=str(path.relative_to(workdir)))


def machine() -> str:
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return found.stdout.strip() or "no GPU found"
    except OSError:
        return "no GPU found"


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.deadline
    intervals = (args.eval_interval, args.samples_interval)
    recipes = [
        Recipe(env, args.suffix, str(args.model), args.workdir, args.max_steps, *intervals)
        for env in args.envs
    ]
    assign_ports(recipes)
    for recipe in recipes:
        recipe.check()
    meta = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "script": " ".join(sys.argv)}
    runs: list[dict[str, Any]] = []
    # warm-ups first, side by side; RL runs without one start at once
    running: list[tuple[Recipe, subprocess.Popen]] = []
    for recipe in recipes:
        if recipe.sft_config is None:
            running.append((recipe, recipe.start_rl(recipe.model)))
    warming = [recipe for recipe in recipes if recipe.sft_config is not None]
    with ThreadPoolExecutor(max(1, len(warming))) as pool:  # the warm-ups side by side
        for recipe, start in zip(warming, pool.map(lambda r: r.warm_up(deadline), warming), strict=True):
            if start is None:
                runs.append(recipe.result(None, False))
                continue
            running.append((recipe, recipe.start_rl(start)))
    while running:  # each run collected as it ends (its wall time then), the rest stopped at the deadline
        if time.monotonic() >= deadline:  # all at once: each takes seconds to stop what it started
            for _, process in running:
                if process.poll() is None:
                    process.terminate()
        ended = [(r, p) for r, p in running if p.poll() is not None or time.monotonic() >= deadline]
        if not ended:
            time.sleep(2.0)
            continue
        for recipe, process in ended:
            running.remove((recipe, process))
            code, stopped = wait(process, deadline)
            runs.append(recipe.result(code, stopped or time.monotonic() >= deadline))
            write(args.out, runs, meta)
            print(f"[real_models] {recipe.dir.name}: {json.dumps(runs[-1])}", flush=True)
        if args.raw:
            pack(args.workdir, args.raw)
    write(args.out, runs, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the base model: a .gguf file or HF dir")
    parser.add_argument(
        "--suffix", required=True, help="recipe files are examples/<env>/{sft,rl}_<suffix>.toml"
    )
    parser.add_argument(
        "--envs", nargs="+", required=True,
        help="ENV or ENV:VARIANT (rl_<suffix>_<variant>.toml), then +STEPS (warm-up steps) and/or @LR (RL lr)",
    )  # fmt: skip
    for flag, what in (  # each RL run's; default: each recipe's own
        ("--max-steps", "max_steps (the deadline may stop a run first)"),
        ("--eval-interval", "online eval interval (an eval before a deadline stops it)"),
        ("--samples-interval", "samples.jsonl interval (recipes: 10; 1-2 to read a short run's rollouts)"),
    ):
        parser.add_argument(
            flag, type=int, default=None, help=f"every RL run's {what}; default: the recipe's"
        )
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=540, help="seconds from now: every run is stopped")
    parser.add_argument("--raw", type=Path, help="a tar.gz of every run's metrics, evals and logs")
    parser.add_argument("--cpu", action="store_true", help="no GPU-sharing flags (a check of this script)")
    args = parser.parse_args()
    EXTRA[:] = [] if args.cpu else SHARED_GPU_FLAGS
    try:
        run(args)
    finally:
        stop_started()


if __name__ == "__main__":
    main()

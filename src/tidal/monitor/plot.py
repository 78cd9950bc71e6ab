"""Plot an RL run: reward and throughput against step, from the orchestrator's and trainer's metrics."""

from pathlib import Path

from tidal import run_layout
from tidal.monitor.metrics import read_metrics


def plot_rl_run(output_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    orch = read_metrics(run_layout.orchestrator_dir(output_dir) / "metrics.jsonl")
    trainer_path = run_layout.trainer_dir(output_dir) / "metrics.jsonl"
    trainer = read_metrics(trainer_path) if trainer_path.exists() else []
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot([m["step"] for m in orch], [m["reward/mean"] for m in orch], label="reward (mean over rollouts)")
    top.set_ylabel("reward")
    top.grid(alpha=0.3)
    top.legend()
    bottom.plot([m["step"] for m in orch], [m["tokens_per_s"] for m in orch], label="inference tokens/s")
    if trainer:
        bottom.plot(
            [m["step"] for m in trainer], [m["tokens_per_s"] for m in trainer], label="trainer tokens/s"
        )
    bottom.set_xlabel("step")
    bottom.set_ylabel("tokens/s")
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.suptitle(f"tidal rl: {Path(output_dir).name}")
    target = Path(output_dir) / "plots" / "rl.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return target

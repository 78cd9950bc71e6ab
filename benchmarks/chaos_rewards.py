"""Does a run that loses processes learn as one that does not? The chaos run of issue 14 against the same run
without kills, after an SFT warm-up, on the CPU and the tiny model.

What runs (all real processes): a short reverse_text SFT (`examples/reverse_text/sft.toml`, 100 steps) so
that the sampled reward is well above 0 and RL moves it; then, from that model, the chaos run of
`tests/integration/test_restarts.py` (two replicas, `max_async_level = 2`, six SIGKILLs at steps drawn
from a fixed seed, as its `CHAOS_PLAN` says: both replicas at once, then the trainer, a reward worker, the
orchestrator, the trainer) and the same run without kills. It checks what the test checks
(every step trained once, no rollout twice, every kill in events.jsonl with its recovery) and reports the
mean sampled reward of the first 5 and last 10 steps of both runs, the wall times, and the seconds from
each kill to the trainer's next trained step per role.

    python benchmarks/chaos_rewards.py --out benchmarks/results/chaos_rewards_cpu.json   # 15-25 minutes
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from tests.conftest import run_tidal  # noqa: E402
from tests.integration import test_restarts as chaos  # noqa: E402
from tidal.monitor.metrics import read_metrics  # noqa: E402


def sft_warmup(out: Path, steps: int) -> Path:
    result = run_tidal(
        "sft", "@", "examples/reverse_text/sft.toml", "--max-steps", str(steps), "--output-dir", str(out),
        "--eval.num-examples", "20", timeout=900,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"the SFT warm-up failed: {result.stderr[-3000:]}")
    return out / "final"


def rewards(out: Path) -> dict[str, float]:
    records = read_metrics(out / "orchestrator" / "metrics.jsonl")
    return {
        "first_5_steps": statistics.mean(r["reward/mean"] for r in records[:5]),
        "last_10_steps": statistics.mean(r["reward/mean"] for r in records[-10:]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=50, help="RL steps of each run (the test runs CHAOS_STEPS)"
    )
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = sft_warmup(root / "sft", args.sft_steps)
        start = time.monotonic()
        run, rollouts = chaos.run_chaos(root / "chaos", 18571, args.steps, model)
        with_kills_s = time.monotonic() - start
        chaos.check_every_step_once(run, args.steps)
        trained = [i for step in sorted(rollouts.ids) for i in rollouts.ids[step]]
        checks = {
            "every_step_once": True,  # check_every_step_once raised otherwise
            "no_rollout_twice": not rollouts.rewritten and len(trained) == len(set(trained)),
            "kills_in_events": [e["role"] for e in run.events("failure")] == [r for r, _, _ in run.kills],
            "processes_left": run.left_alive(),
        }
        start = time.monotonic()
        reference = chaos.Run.start(root / "reference", *chaos.chaos_args(18581, args.steps, model))
        if reference.finish(timeout=1200) != 0:
            raise SystemExit(f"the run without kills failed: {reference.output()[-3000:]}")
        without_kills_s = time.monotonic() - start
        report = {
            "command": shlex.join(["python", "benchmarks/chaos_rewards.py", *argv]),
            "date": time.strftime("%Y-%m-%d"),
            "machine": "the 2-core CPU machine, tiny model, filesystem transport, trainer.ckpt.interval 2",
            "steps": args.steps,
            "kills": [{"role": r, "trained_steps_at_kill": n} for r, _, n in run.kills],
            "checks": checks,
            "reward": {"with_kills": rewards(run.out), "without_kills": rewards(reference.out)},
            "wall_s": {"with_kills": with_kills_s, "without_kills": without_kills_s},
            "seconds_from_kill_to_next_trained_step": chaos.recovery_seconds(run),
        }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make demo`: the reverse-text example on the CPU, end to end, with the numbers that matter printed.

Today it runs the SFT warm-up (outputs/demo/sft); the RL stage joins it when `tidal rl` lands.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

from tidal.monitor.metrics import read_metrics

OUT = Path("outputs/demo")
SFT_CONFIG = "examples/reverse_text/sft.toml"


def run(args: list[str]) -> None:
    print("$ tidal " + " ".join(args), flush=True)
    code = subprocess.call([sys.executable, "-m", "tidal", *args])
    if code != 0:
        sys.exit(f"demo: `tidal {args[0]}` failed with exit code {code}")


def main() -> None:
    sft_dir = OUT / "sft"
    if sft_dir.exists():
        print(f"demo: removing the previous demo run in {sft_dir}")
        shutil.rmtree(sft_dir)
    start = time.perf_counter()
    run(["sft", "@", SFT_CONFIG, "--output-dir", str(sft_dir)])
    metrics = read_metrics(sft_dir / "metrics.jsonl")
    losses = [m["loss"] for m in metrics if "loss" in m]
    exact = next(m["eval/exact_match"] for m in metrics if "eval/exact_match" in m)
    print()
    print(f"demo: SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    print(f"demo: held-out greedy exact match {exact:.3f}")
    print(f"demo: model in {sft_dir / 'final'} (loads with transformers and vLLM)")
    print(f"demo: done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

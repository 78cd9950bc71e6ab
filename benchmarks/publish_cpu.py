"""Filesystem publish of a real model's weights on the CPU: the trainer's publisher against a full export.

The model is SmolLM2-135M-Instruct (from its GGUF asset, converted once by tidal), held in fp32 as the
trainer's master weights and published in bf16, as `tidal rl` does. Alternating in one call, `--repeats`
times each:

- `export`: the path filesystem publishing took before: gather the fp32 state dict, cast it on the CPU,
  serialise config, tokenizer and generation config again (`tidal.trainer.export.export_model`);
- `publisher`: `FilesystemPublisher.publish`: cast where the weights live, the other files made once.

On a GPU the cast runs on the device; here both casts run on the CPU, so the difference is the order of the
work (cast before copy) and the files written once. The machine's load is printed with the result: the CPU
cast is the part that suffers most from a busy machine.

    python benchmarks/publish_cpu.py --out benchmarks/results/publish_cpu.json
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from recipes_cpu import machine  # noqa: E402 - the sibling benchmarks' machine line


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, each a round")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.models import resolve_model_name
    from tidal.testing.assets import ASSETS, fetch_gguf
    from tidal.trainer.export import export_model
    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import FilesystemPublisher

    directory = resolve_model_name(str(fetch_gguf(ASSETS["smollm2"])))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="publish_cpu_"))
    rounds = {}
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            publisher = FilesystemPublisher(work / "run", keep_last=2, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {"export": [], "publisher": []}
            for step in range(args.repeats):
                target = work / "export" / f"step_{step}"
                export = functools.partial(export_model, target, model, tokenizer, info, torch.bfloat16)
                times["export"].append(timed(export))
                shutil.rmtree(target)
                times["publisher"].append(
                    timed(functools.partial(publisher.publish, step, model, tokenizer, info))
                )
            medians = {name: statistics.median(values) for name, values in times.items()}
            rounds[f"threads_{threads}"] = {
                "seconds": {name: [round(v, 3) for v in values] for name, values in times.items()},
                "median_s": {name: round(v, 3) for name, v in medians.items()},
                "export_over_publisher": round(medians["export"] / medians["publisher"], 2),
            }
            print(
                f"torch threads {threads}: {json.dumps(rounds[f'threads_{threads}']['median_s'])}", flush=True
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": "python benchmarks/publish_cpu.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "model": "SmolLM2-135M-Instruct (fp32 master weights, published in bf16)",
        "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

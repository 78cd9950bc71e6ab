"""Time the checks a filesystem weight update goes through before it loads (`tidal.transport.weight_checks`).

A synthetic bf16 checkpoint of `--gib` GiB (tensors of 16M values) is written to a temporary directory,
then timed, each `--repeats` times from the page cache (as the trainer's fresh files are): the header
checks (names, shapes, dtypes against itself) and the full check that also reads every value for NaN/inf.

    python benchmarks/weight_checks.py --gib 1.0 --out benchmarks/results/weight_checks_cpu.json
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    from tidal.transport.weight_checks import Reference, update_problem

    numel = 16 * 2**20
    count = max(1, round(args.gib * 2**30 / (2 * numel)))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        generator = torch.Generator().manual_seed(0)
        tensors = {f"w.{i}": torch.randn(numel, generator=generator).to(torch.bfloat16) for i in range(count)}
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")
        size = (directory / "model.safetensors").stat().st_size
        del tensors
        reference = Reference.from_dir(directory)
        update_problem(directory, reference, check_finite=True)  # warm the page cache
        timings: dict[str, list[float]] = {"headers": [], "full": []}
        for _ in range(args.repeats):
            for label, finite in (("headers", False), ("full", True)):
                start = time.perf_counter()
                assert update_problem(directory, reference, check_finite=finite) is None
                timings[label].append(time.perf_counter() - start)
    result = {
        "file_gib": size / 2**30,
        "tensors": count,
        "headers_s_median": statistics.median(timings["headers"]),
        "full_s_median": statistics.median(timings["full"]),
        "full_s_per_gib": statistics.median(timings["full"]) / (size / 2**30),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "timings": timings,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""How fast `tidal sft` turns conversations with pictures into samples: in the training process (the
baseline, `data.picture_workers = 0`) against worker processes (`SamplePool`), in one call; and what
receiving them costs the training process, with the pictures piped back whole (the way before) against
through shared memory.

No model runs and no GPU is needed: this is the CPU work that, in the training process, left the GPU idle
between steps (SmolVLM's processor cuts each picture into five 512-pixel tiles). Each side draws the same
batches of the built-in `shapes` demonstrations (sft_smolvlm.toml's data) and takes them as a training loop
would, one batch per step; `--step-seconds` sleeps that long per step in place of the GPU's work, so that the
workers can prepare the next batch meanwhile, as in a real run.

    python -m tidal.models.smolvlm_shape --text <SmolLM2 HF dir> --out /tmp/smolvlm-shape
    python benchmarks/picture_prep.py --model /tmp/smolvlm-shape --workers 1 --steps 4 \\
        --out benchmarks/results/picture_prep_cpu.json
"""

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config.deployment import usable_cores
from tidal.config.sft import SFTConfig
from tidal.models.vision import setup_pictures
from tidal.trainer.parallel import DistInfo
from tidal.trainer.sample_pool import SamplePool, auto_workers
from tidal.trainer.sft import SFTData
from tidal.trainer.sources import load_conversations


def side(
    config: SFTConfig,
    conversations: list,
    pictures: Any,
    workers: int,
    steps: int,
    step_s: float,
    shared_memory: bool = True,
) -> dict:
    """Seconds each step waited for its batch, with `workers` processes (0: prepared in this process), and
    the CPU seconds this process spent while the step ran (receiving the next batch from the workers)."""
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    started = time.perf_counter()
    pool = SamplePool(workers, pictures.tokenizer, pictures, shared_memory) if workers else None
    data = SFTData(config, conversations, pictures.tokenizer, info, pictures, pool)
    waits, tokens, joins, busy = [], 0, [], []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            batch = data.next_batch()
            waits.append(time.perf_counter() - begin)
            tokens += batch.num_tokens
            joins.append(join_seconds(batch))
            cpu = time.process_time()
            time.sleep(step_s)  # the GPU's step, during which the workers prepare the next batch
            busy.append(time.process_time() - cpu)
    finally:
        if pool is not None:
            pool.close()
    wall = time.perf_counter() - started
    samples = steps * config.data.batch_size
    return {
        "workers": workers,
        "pictures_through": "shared memory" if shared_memory else "the pipe, with their text",
        # a real step launches GPU kernels from this process's Python thread: CPU taken here meanwhile
        # (unpickling what the workers send, under the GIL) slows the step itself
        "trainer_cpu_during_step_s": [round(b, 3) for b in busy],
        "wait_per_step_s": [round(w, 3) for w in waits],
        "mean_wait_after_first_s": round(sum(waits[1:]) / max(1, len(waits) - 1), 3),
        "wall_s": round(wall, 2),
        "samples_per_s": round(samples / wall, 2),
        "tokens_per_step": tokens // steps,
        # the training step's own CPU work on the pictures: joining each micro-batch's into tensors, from
        # the arrays the samples keep, and (the way before they were kept) decoded from their base64 text
        "join_per_step_s": round(sum(kept for kept, _ in joins) / steps, 3),
        "join_from_text_per_step_s": round(sum(text for _, text in joins) / steps, 3),
    }


def join_seconds(batch: Any) -> tuple[float, float]:
    """Seconds to join the batch's pictures per micro-batch (what `train_step` does before the forward):
    from the kept arrays, and from copies that hold the text alone."""
    from dataclasses import replace

    from tidal.trainer.data import collate_pictures
    from tidal.types import PackedArray

    def text_only(array: PackedArray | None) -> PackedArray | None:
        return None if array is None else PackedArray(array.data, array.shape, array.dtype)

    times = []
    for fresh in (False, True):
        begin = time.perf_counter()
        for rows in batch.micro_batches:
            if fresh:
                rows = [
                    replace(r, pictures=[replace(p, pixel_values=text_only(p.pixel_values),
                                                 pixel_attention_mask=text_only(p.pixel_attention_mask))
                                         for p in r.pictures])
                    for r in rows
                ]  # fmt: skip
            collate_pictures(rows)
        times.append(time.perf_counter() - begin)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a vision-language model's directory (its processor)")
    parser.add_argument("--workers", type=int, default=auto_workers(1), help="default: what tidal sft takes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="sft_smolvlm.toml's data.batch_size")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a stand-in for the GPU's step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    config = SFTConfig(
        model={"name": args.model},
        data={
            "train": {"type": "builtin", "name": "shapes", "split": "train",
                      "num_examples": args.batch_size * args.steps, "kwargs": {"min_turns": 1, "max_turns": 2}},
            "batch_size": args.batch_size, "seq_len": 2048, "micro_batch_size": 4,
        },
    )  # fmt: skip
    conversations = load_conversations(config.data.train)
    pictures = setup_pictures(args.model)
    baseline = side(config, conversations, pictures, 0, args.steps, args.step_seconds)
    piped = side(config, conversations, pictures, args.workers, args.steps, args.step_seconds, False)
    pooled = side(config, conversations, pictures, args.workers, args.steps, args.step_seconds)
    result = {
        "what": "tidal sft's sample preparation for conversations with pictures: in the training process "
        "(baseline) against worker processes, the same batches (benchmarks/picture_prep.py)",
        "machine": f"{platform.processor() or platform.machine()}, {len(usable_cores())} cores",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "model": Path(args.model).name,
        "batch_size": args.batch_size,
        "step_seconds_stand_in": args.step_seconds,
        "in_process": baseline,
        "workers_piped": piped,
        "workers": pooled,
        "wait_ratio_workers_to_in_process": round(
            pooled["mean_wait_after_first_s"] / max(1e-9, baseline["mean_wait_after_first_s"]), 3
        ),
        "samples_per_s_ratio": round(pooled["samples_per_s"] / baseline["samples_per_s"], 2),
        "trainer_cpu_during_step_ratio_shared_to_piped": round(
            sum(pooled["trainer_cpu_during_step_s"][1:])
            / max(1e-9, sum(piped["trainer_cpu_during_step_s"][1:])),
            3,
        ),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Where a vision-language model's SFT step spends its time: tidal's train step against the model's own
forward and loss in bf16 weights, on the same batches, in one call.

The SmolVLM-shaped model's SFT step (sft_smolvlm.toml: 32 `shapes` conversations, a picture each cut into
five 512-pixel tiles, packed into rows of 2,048 tokens, micro-batches of 4 rows, the vision tower training)
took ~3.5 s on an H100 (benchmarks/results/vlm_h100_attempt.json), slow for 228M parameters. Two sides run
the same batches, prepared before timing (no picture preparation is timed):

- `tidal`: `tidal.trainer.sft.train_step` on the scorer `tidal sft` builds (one GPU: bf16 autocast over fp32
  masters, the run's activation checkpointing of the language model's layers);
- `reference`: the Hugging Face model with bf16 weights, its own forward and loss (`labels`), AdamW; no
  fp32 masters, no checkpointing: a lower bound for the work, not a recipe.

Each side reports seconds per step, peak GPU memory and a torch.profiler table of one step (the kernels that
took the most GPU time, and the share of the step's wall the GPU was busy).

    python -m tidal.models.smolvlm_shape --text <SmolLM2 HF dir> --out /tmp/smolvlm-shape
    python benchmarks/vlm_step.py --model /tmp/smolvlm-shape --out benchmarks/results/vlm_step_h200.json
"""

import argparse
import gc
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config.sft import SFTConfig
from tidal.models.vision import forward_pictures, setup_pictures
from tidal.trainer.data import IGNORE_INDEX, collate, collate_pictures
from tidal.trainer.parallel import init_distributed
from tidal.trainer.session import open_trainer
from tidal.trainer.sft import SFTData, StepBatch, train_step
from tidal.trainer.sources import load_conversations


def make_config(args: argparse.Namespace, out: Path) -> SFTConfig:
    """sft_smolvlm.toml's data and model settings (the tower training), `--batch-size`/`--micro` rows."""
    return SFTConfig(
        output_dir=out,
        max_steps=args.steps + 1,
        device=args.device,
        model={"name": args.model, "dtype": "bfloat16", "train_vision": True},
        data={
            "train": {"type": "builtin", "name": "shapes", "split": "train",
                      "num_examples": args.batch_size * (args.steps + 1),
                      "kwargs": {"min_turns": 1, "max_turns": 2}},
            "batch_size": args.batch_size, "seq_len": 2048, "micro_batch_size": args.micro,
            "picture_workers": 0,
        },
        optim={"lr": 1e-5},
    )  # fmt: skip


def profile_table(prof: Any, wall_s: float, rows: int = 15) -> dict[str, Any]:
    """The kernels with the most GPU time in a profiled step, and the GPU-busy share of its wall."""
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))

    busy = sum(device_us(e) for e in events) / 1e6
    top = sorted(events, key=device_us, reverse=True)[:rows]
    return {
        "gpu_busy_s": round(busy, 3),
        "gpu_busy_share_of_wall": round(busy / wall_s, 3) if wall_s else None,
        "top_kernels": [
            {"name": e.key[:120], "calls": e.count, "gpu_ms": round(device_us(e) / 1e3, 2)} for e in top
        ],
    }


def timed(step: Any, batches: list[StepBatch], device: torch.device) -> dict[str, Any]:
    """One warm-up step, then each batch timed; then the last batch again under the profiler."""
    cuda = device.type == "cuda"
    step(batches[0])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for batch in batches[1:]:
        begin = time.perf_counter()
        step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    result: dict[str, Any] = {
        "step_s": [round(t, 3) for t in times],
        "mean_step_s": round(sum(times) / len(times), 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            begin = time.perf_counter()
            step(batches[-1])
            torch.cuda.synchronize()
            wall = time.perf_counter() - begin
        result["profiled_step_s"] = round(wall, 3)
        result["profile"] = profile_table(prof, wall)
    return result


def reference_side(model_dir: str, batches: list[StepBatch], device: torch.device) -> dict[str, Any]:
    """The same micro-batches through the HF model in bf16 weights: its forward with `labels`, AdamW."""
    from transformers import AutoModelForImageTextToText

    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.to(device)
    model.config.use_cache = False
    model.train()
    kind = str(model.config.model_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step(batch: StepBatch) -> None:
        for rows in batch.micro_batches:
            inputs = {k: v.to(device) for k, v in collate(rows).items()}
            pictures = forward_pictures(kind, collate_pictures(rows, device))
            pictures = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in pictures.items()}
            # tidal's labels are already each position's next token and HF shifts them once more: the same
            # work with a loss one token off, which only the timing reads
            labels = torch.where(inputs["labels"] != IGNORE_INDEX, inputs["labels"], -100)
            out = model(
                input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], labels=labels,
                use_cache=False, **pictures,
            )  # fmt: skip
            out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, batches, device)


def tidal_side(args: argparse.Namespace, info: Any, work: Path) -> tuple[dict[str, Any], list[StepBatch]]:
    """The trainer `tidal sft` builds, its train step timed on batches prepared first; the batches too."""
    config = make_config(args, work / "sft")
    conversations = load_conversations(config.data.train)
    t = open_trainer(config, info, work / "metrics.jsonl", work / "ckpt")
    data = SFTData(config, conversations, t.tokenizer, info, setup_pictures(args.model), None)
    batches = [data.next_batch() for _ in range(args.steps + 1)]

    def step(batch: StepBatch) -> None:
        train_step(t.scorer, t.optimizer, t.scheduler, batch, info, 1.0)

    return timed(step, batches, info.device), batches


def free_gpu(device: torch.device) -> None:
    """Give the side before's memory back, so that the next side's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a vision-language model's directory")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=32, help="sft_smolvlm.toml's data.batch_size")
    parser.add_argument("--micro", type=int, default=4, help="packed rows per micro-batch")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    info = init_distributed(args.device)
    with tempfile.TemporaryDirectory() as work:
        tidal, batches = tidal_side(args, info, Path(work))
    free_gpu(info.device)
    reference = reference_side(args.model, batches, info.device)
    micro = [len(b.micro_batches) for b in batches]
    name = torch.cuda.get_device_name() if info.device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "what": "the SmolVLM-shaped model's SFT step: tidal's train_step against the HF model's own forward "
        "and loss in bf16 weights, the same batches (benchmarks/vlm_step.py)",
        "machine": name,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": f"python benchmarks/vlm_step.py --model <smolvlm-shape> --steps {args.steps} "
        f"--batch-size {args.batch_size} --micro {args.micro}",
        "conversations_per_step": args.batch_size,
        "micro_batches_per_step": micro,
        "tokens_per_step": [b.num_tokens for b in batches],
        "tidal": tidal,
        "reference_hf_bf16": reference,
        "step_ratio_tidal_to_reference": round(tidal["mean_step_s"] / reference["mean_step_s"], 2),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

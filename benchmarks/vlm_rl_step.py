"""The RL trainer's forward and backward on a vision-language model's micro-batch whose groups share their
prompt's picture: the vision tower once per sample (baseline, as before) against once per distinct picture
(`MicroBatch.picture_tensors(once=True)`, what `tidal rl`'s trainer does), in one call.

A group's samples all carry their prompt's picture; with `group_size` 8 the tower used to run 8 times on
it. Both sides score the same micro-batch with the same model (the tower training), and the script reports
seconds per forward and backward, the tiles the tower saw, and the largest difference between the two
sides' logprobs.

    python benchmarks/vlm_rl_step.py --model /tmp/smolvlm-shape --groups 1 --group-size 4 \\
        --out benchmarks/results/vlm_rl_step_cpu.json
"""

import argparse
import base64
import io
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from tidal.config.common import ModelConfig
from tidal.envs.base import render_prompt
from tidal.models.vision import setup_pictures
from tidal.orchestrator.batching import build_micro_batch, make_train_samples
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.model import load_model
from tidal.types import Group, MicroBatch, Rollout


def picture_url(seed: int) -> str:
    """A 112-pixel picture of one coloured square (the shapes environment's size)."""
    image = Image.new("RGB", (112, 112), (255, 255, 255))
    image.paste((40 * seed % 256, 120, 200), (20 + seed % 30, 20, 70 + seed % 30, 70))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def micro_batch(model_dir: str, groups: int, group_size: int, seq_len: int) -> MicroBatch:
    """`groups` prompts with a picture each, `group_size` 16-token completions per prompt, packed."""
    pictures = setup_pictures(model_dir)
    samples = []
    for g in range(groups):
        url = picture_url(g)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "How many?"},
                ],
            }
        ]
        prompt = render_prompt(pictures.processor.tokenizer, messages)
        rollouts = [
            Rollout(
                prompt,
                [100 + k] * 16,
                [-1.0] * 16,
                [1] * 16,
                float(k % 2),
                0,
                0,
                "shapes",
                f"t{g}",
                images=[url],
            )
            for k in range(group_size)
        ]
        samples += make_train_samples([Group(f"t{g}", "shapes", rollouts)], expand_pictures=pictures)
    rows: list[list[Any]] = []
    row: list[Any] = []
    used = 0
    for sample in samples:  # first fit in order, as the packer's rows hold consecutive samples
        if used + len(sample.input_ids) > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(sample)
        used += len(sample.input_ids)
    rows.append(row)
    return build_micro_batch(rows, seq_len, 0)


def timed_side(
    scorer: TokenScorer, micro: MicroBatch, once: bool, repeats: int, device: torch.device
) -> dict:
    """Forward and backward `repeats` times (after one warm-up); the tiles the tower saw per pass."""
    tower: Any = scorer.lm.model.vision_model  # type: ignore[union-attr]
    seen: list[int] = []
    hook = tower.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int(kwargs["pixel_values"].shape[0])), with_kwargs=True
    )
    t = micro.to_tensors(device)
    times, logprobs = [], None
    try:
        for index in range(repeats + 1):
            scorer.zero_grad(set_to_none=True)
            begin = time.perf_counter()
            logprobs, _ = scorer(
                t["input_ids"],
                t["position_ids"],
                t["target_ids"],
                pictures=micro.picture_tensors(device, once),
            )
            (logprobs * (t["sample_ids"] >= 0)).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if index:
                times.append(time.perf_counter() - begin)
    finally:
        hook.remove()
    return {
        "once_per_picture": once,
        "tower_tiles_per_pass": seen[-1],
        "seconds": [round(s, 3) for s in times],
        "mean_s": round(sum(times) / len(times), 3),
        "logprobs": logprobs.detach() if logprobs is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an Idefics3 vision-language model's directory")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(ModelConfig(name=args.model, train_vision=True)).to(device)
    scorer = TokenScorer(model)
    if device.type == "cuda":
        scorer.autocast_dtype = torch.bfloat16  # as tidal's one-GPU trainer: bf16 autocast over fp32 masters
    micro = micro_batch(args.model, args.groups, args.group_size, args.seq_len)
    every = timed_side(scorer, micro, False, args.repeats, device)
    once = timed_side(scorer, micro, True, args.repeats, device)
    difference = float((every.pop("logprobs") - once.pop("logprobs")).abs().max())
    result: dict[str, Any] = {
        "what": "the RL trainer's forward and backward with the vision tower once per sample against once per "
        "distinct picture, the same micro-batch (benchmarks/vlm_rl_step.py)",
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": f"python benchmarks/vlm_rl_step.py --model <{Path(args.model).name}> --groups {args.groups} "
        f"--group-size {args.group_size} --seq-len {args.seq_len} --repeats {args.repeats}",
        "rows": len(micro.input_ids),
        "samples": args.groups * args.group_size,
        "tower_every_sample": every,
        "tower_once_per_picture": once,
        "time_ratio_once_to_every": round(once["mean_s"] / every["mean_s"], 3),
        "max_abs_logprob_difference": difference,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""On-policy distillation in plain PyTorch, outside tidal: the reference for tidal's distillation path.

The loop is the method in its simplest form, on CPU with transformers: the student samples (temperature 1,
no top-k/top-p), the frozen teacher scores the student's own tokens, and the loss is
−Σ_t (q_t − s_t)·log π(t) / #tokens with q_t − s_t detached (on-policy: importance ratio 1), AdamW, gradient
norm clipped to 1.0 (`--clip-advantage`: q_t − s_t clamped first). If this loop and `tidal rl` with `[teacher_server]` behave alike on a pair, what they
show is the method on that pair, not tidal's plumbing. Per step it logs the reverse KL per token and per
sequence (student − teacher logprob summed over the completion), the completion length, the reward from the
math environment's own answer check and the gradient norm before clipping.

    python benchmarks/distill_reference.py --teacher <teacher dir or .gguf> --student <student dir> \\
        --steps 8 --lr 1e-5 --out benchmarks/results/distill_reference_cpu.json
    # the student: python benchmarks/distill_vs_rl.py student <teacher> <student dir> 8,16
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def completion_mask(completions: Any, ends: set[int]) -> Any:
    """True on each completion's tokens up to and including its first end-of-turn token."""
    import torch

    mask = torch.ones_like(completions, dtype=torch.bool)
    for row, ids in enumerate(completions.tolist()):
        first = next((k for k, token in enumerate(ids) if token in ends), None)
        if first is not None:
            mask[row, first + 1 :] = False
    return mask


def token_logprobs(model: Any, ids: Any, attention: Any, start: int) -> Any:
    """log p(ids[:, t] | ids[:, :t]) for t ≥ start: [rows, len - start]."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, start - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, start:, None])[..., 0]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.envs.math_env import MathEnv, verify_answer
    from tidal.models import resolve_model_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (pool order)")
    parser.add_argument("--samples", type=int, default=4, help="samples a prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--clip-advantage", type=float, default=0.0, help="clamp q - s to ±this per token (0: no clamp)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    teacher_dir = resolve_model_name(args.teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    tokenizer.padding_side = "left"
    teacher: Any = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student: Any = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    env = MathEnv(level="arithmetic", num_examples=256, split="train")  # distill_vs_rl.py's pool
    ends = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    rows = []
    for step in range(args.steps):
        began = time.monotonic()
        tasks = [env.task((step * args.prompts + i) % 256) for i in range(args.prompts)]
        prompts = [
            tokenizer.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True)
            for t in tasks
        ]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        student.eval()
        with torch.no_grad():
            ids = student.generate(
                **batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                num_return_sequences=args.samples, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        start = batch.input_ids.shape[1]
        mask = completion_mask(ids[:, start:], ends)
        attention = torch.cat([batch.attention_mask.repeat_interleave(args.samples, 0), mask.long()], 1)
        with torch.no_grad():
            q = token_logprobs(teacher, ids, attention, start)
        student.train()
        s = token_logprobs(student, ids, attention, start)
        weights = mask.float()
        advantage = q - s.detach()
        if args.clip_advantage > 0:  # the heavy tail: one wrong digit can weigh −10 nats
            advantage = advantage.clamp(-args.clip_advantage, args.clip_advantage)
        loss = -(advantage * s * weights).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        gap = (s.detach() - q) * weights
        texts = tokenizer.batch_decode(ids[:, start:], skip_special_tokens=True)
        scores = [verify_answer(text, tasks[k // args.samples].answer) for k, text in enumerate(texts)]
        row = {
            "step": step,
            "reverse_kl_per_token": round(float(gap.sum() / weights.sum()), 3),
            "reverse_kl_per_sequence": round(float(gap.sum(1).mean()), 2),
            "completion_tokens": round(float(weights.sum(1).mean()), 1),
            "reward": round(sum(scores) / len(scores), 3),
            "grad_norm_before_clip": round(float(grad_norm), 1),
            "seconds": round(time.monotonic() - began, 1),
            "first_sample": texts[0][:80],
        }
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    if args.out:
        document = {
            "what": __doc__.splitlines()[0],
            "args": vars(args) | {"out": str(args.out)},
            "steps": rows,
        }
        args.out.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""Which decoder layers a student may lack: the teacher's pass rate on math arithmetic with layers removed.

distill_vs_rl.py's student is the teacher without some layers. Too few removed and there is nothing to
distil; too many and the student writes garbage, RL's reward is 0 everywhere and RL stops at step 0. This
samples each candidate (transformers, temperature 1, the chat template) on the first problems of the pool
the distill recipes train on and scores them with the environment's own answer check:

    python benchmarks/distill_student_probe.py <teacher dir or .gguf> all 22 21,22 8,16 every-other \\
        --out benchmarks/results/distill_student_probe_cpu.json
    # the teacher and the student as the online evals score them: held-out problems, greedy
    python benchmarks/distill_student_probe.py <teacher> all 8,16 --split heldout --greedy --tasks 100
"""

import argparse
import json
import time

import torch
from distill_vs_rl import load_student, parse_drop  # a sibling benchmark
from transformers import AutoTokenizer

from tidal.envs.math_env import MathEnv, verify_answer
from tidal.models import resolve_model_name


def dropped_layers(spec: str) -> list[int] | None:
    """`all` (none dropped), `every-other` (None: load_student's default) or comma-separated layers to drop."""
    return [] if spec == "all" else None if spec == "every-other" else parse_drop(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("teacher")
    parser.add_argument("candidates", nargs="+", help="all, every-other, or layers to drop (e.g. 8,16)")
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument(
        "--split", default="train", help="train (the recipes' pool) or heldout (the online evals')"
    )
    parser.add_argument(
        "--greedy", action="store_true", help="greedy, one sample a task (as the online evals)"
    )
    parser.add_argument(
        "--level",
        default="arithmetic",
        help="math's level: arithmetic (the recipes'), products, word_problems",
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out")
    args = parser.parse_args()
    source = resolve_model_name(args.teacher)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.padding_side = "left"
    env = MathEnv(level=args.level, num_examples=256, split=args.split)  # train: the recipes' pool
    samples = 1 if args.greedy else args.samples
    sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": 1.0}
    tasks = [env.task(i) for i in range(args.tasks)]
    prompts = [
        tokenizer.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True) for t in tasks
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    results = []
    for spec in args.candidates:
        model = load_student(source, dropped_layers(spec))  # a fresh load each: ~1 s for a 0.5B model
        torch.manual_seed(0)
        began = time.monotonic()
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=args.max_tokens,
                num_return_sequences=samples,
                **sampling,
            )
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
        scores = [verify_answer(text, tasks[k // samples].answer) for k, text in enumerate(texts)]
        lengths = (out[:, batch.input_ids.shape[1] :] != tokenizer.pad_token_id).sum(dim=1).float()
        row = {
            "candidate": spec,
            "level": args.level,
            "mean_tokens": round(lengths.mean().item(), 1),
            "layers": model.config.num_hidden_layers,
            "pass_rate": round(sum(scores) / len(scores), 4),
            "samples": len(scores),
            "seconds": round(time.monotonic() - began, 1),
            "first_reply": texts[0][:160],
        }
        results.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    if args.out:
        document = {"what": __doc__.splitlines()[0], "teacher": args.teacher, "results": results}
        with open(args.out, "w") as handle:
            handle.write(json.dumps(document, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""SFT conversations from a built-in environment's own tasks: the `demonstration` of each task of a split.

Every built-in environment takes `split` ("train" or "heldout") and holds only the tasks of that split, by
one rule (`tidal.envs.splits`: a stable hash of what makes the task that task: a wordle word, a math
question, the names to sort, a code task's id), so the two splits never share a task whatever the seed or
the sizes, and the held-out demonstrations are the tasks that `tidal rl` evaluates online. `reverse_text`
keeps its own generator (the same rule, on the text), whose order predates the environment's.

    python -m tidal.envs.demonstrations alphabet_sort --split heldout --num-examples 5 --out /tmp/demo.jsonl
"""

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

from tidal.config.env_names import BUILTIN_ENVS
from tidal.envs.base import Environment
from tidal.envs.splits import SPLITS
from tidal.errors import UserError

Conversation = list[dict[str, Any]]


def env_demonstrations(env: Environment, num_examples: int | None) -> list[Conversation]:
    """Demonstrations of the environment's first `num_examples` tasks (None: all of them) in task order; a
    task without a correct conversation (`demonstration` returns None) is skipped."""
    out: list[Conversation] = []
    for index in range(env.num_tasks()):
        if num_examples is not None and len(out) >= num_examples:
            break
        demonstration = env.demonstration(env.task(index))
        if demonstration is not None:
            out.append(demonstration)
    return out


def generate_demonstrations(
    name: str, split: str, num_examples: int | None, seed: int | None, kwargs: dict[str, Any]
) -> list[Conversation]:
    """The `split` demonstrations of built-in environment `name` built with `kwargs` (and `seed`, None: the
    environment's default). Fewer tasks than `num_examples`, none at all, a wrong argument, an environment
    without demonstrations: one-line `UserError`s."""
    from tidal.envs import reverse_text
    from tidal.envs.registry import resolve_env

    what = f"built-in dataset {name!r}"
    if name not in BUILTIN_ENVS:
        raise UserError(f"unknown {what} (built-in: {', '.join(sorted(BUILTIN_ENVS))})")
    if split not in SPLITS:
        raise UserError(f"{what}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if name == "reverse_text":
        if kwargs:
            raise UserError(f"{what} takes no kwargs (got {', '.join(sorted(kwargs))})")
        return reverse_text.generate_conversations(split, num_examples or 10_000, seed or 0)
    resolved = resolve_env(name)
    arguments = dict(kwargs)
    if "split" in arguments:
        raise UserError(f"{what}: split is given twice (split and kwargs.split); give one")
    arguments["split"] = split
    if seed is not None:
        if "seed" in arguments:
            raise UserError(f"{what}: seed is given twice (seed and kwargs.seed); give one")
        if "seed" not in inspect.signature(resolved.factory).parameters:
            raise UserError(f"{what}: environment {name!r} has no seed (its tasks are a fixed list)")
        arguments["seed"] = seed
    env = resolved.build(**arguments)
    try:
        conversations = env_demonstrations(env, num_examples)
    except NotImplementedError:
        raise UserError(f"{what}: environment {name!r} has no demonstrations") from None
    if not conversations or (num_examples is not None and len(conversations) < num_examples):
        raise UserError(
            f"{what}: its {split} split has {len(conversations)} demonstrations of {env.num_tasks()} tasks, "
            f"fewer than num_examples = {num_examples} (leave num_examples unset for all of them, or give "
            "the environment more tasks in kwargs)"
            if conversations
            else f"{what}: its {split} split holds no task of the environment's {env.num_tasks()}"
        )
    return conversations


def main() -> None:
    parser = argparse.ArgumentParser(description="Write an environment's demonstrations as JSONL.")
    parser.add_argument("name", choices=sorted(BUILTIN_ENVS))
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--num-examples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kwargs", type=json.loads, default={}, help="environment arguments as JSON")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        conversations = generate_demonstrations(
            args.name, args.split, args.num_examples, args.seed, args.kwargs
        )
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as fh:
        for messages in conversations:
            fh.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {len(conversations)} {args.split} demonstrations of {args.name} to {args.out}")


if __name__ == "__main__":
    main()

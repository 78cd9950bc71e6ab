"""What the orchestrator's event loop spends at the end of a step, before and after: the batch's wire encoding
(json.dumps against msgspec, `tidal.transport.rollouts.encode`), the trainer's decoding, and the saved
state's groups (`dataclasses.asdict` against `Group.to_dict`), on one synthetic step of real sizes.

While these run no turn of any episode continues and no weight-update call proceeds (the stall shows as
`event_loop/lag_max_s` in the orchestrator's metrics, once a step; issue 34). The step: 32 groups × 8
rollouts, prompts of 57 tokens and completions of 100-300 (SmolLM2's alphabet_sort), packed for one rank
into micro-batches of 8 rows of 2048; vocabulary 49,152. Each side is the median of `--repeats` runs.

    python benchmarks/orchestrator_step_end.py --out benchmarks/results/orchestrator_step_end_cpu.json
"""

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tidal.orchestrator.batching import drop_too_long, make_train_batches, make_train_samples  # noqa: E402
from tidal.transport.rollouts import decode, encode  # noqa: E402
from tidal.types import Group, Rollout, TrainBatch  # noqa: E402


def synthetic_step(seed: int = 0, groups: int = 32, group_size: int = 8) -> list[Group]:
    rng = random.Random(seed)

    def rollout(task: int, index: int) -> Rollout:
        n = rng.randint(100, 300)
        return Rollout(
            prompt_ids=[rng.randrange(49152) for _ in range(57)],
            completion_ids=[rng.randrange(49152) for _ in range(n)],
            completion_logprobs=[-rng.random() for _ in range(n)],
            completion_mask=[1] * n,
            reward=rng.random(),
            policy_version=3,
            policy_version_max=3,
            env="alphabet_sort",
            task_id=f"t{task}",
            rollout_id=f"{task}/{index}",
        )

    return [
        Group(f"t{g}", "alphabet_sort", [rollout(g, i) for i in range(group_size)]) for g in range(groups)
    ]


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(repeats: int) -> dict[str, Any]:
    groups = synthetic_step()
    samples, _ = drop_too_long(make_train_samples(groups), 2048)
    [batch] = make_train_batches(0, samples, 1, 2048, 8, 0)
    wire = encode(batch)
    old_wire = json.dumps(dataclasses.asdict(batch), separators=(",", ":")).encode()
    assert json.loads(wire) == json.loads(old_wire)  # the same message
    sides: dict[str, dict[str, Any]] = {
        "encode_batch": {
            "before": median_s(lambda: json.dumps(batch.to_dict(), separators=(",", ":")), repeats),
            "after": median_s(lambda: encode(batch), repeats),
            "asdict_json": median_s(
                lambda: json.dumps(dataclasses.asdict(batch), separators=(",", ":")), repeats
            ),
            "what": "before: json.dumps(batch.to_dict()); after: tidal.transport.rollouts.encode (msgspec); "
            "asdict_json: json.dumps(asdict(batch)), the encoding before TrainBatch.to_dict stopped deep-copying",
        },
        "decode_batch": {
            "before": median_s(lambda: TrainBatch.from_dict(json.loads(old_wire)), repeats),
            "after": median_s(lambda: decode(wire), repeats),
            "what": "trainer side: json.loads against msgspec's decoder, then TrainBatch.from_dict",
        },
        "state_groups": {
            "before": median_s(lambda: json.dumps([dataclasses.asdict(g) for g in groups[:16]]), repeats),
            "after": median_s(lambda: json.dumps([g.to_dict() for g in groups[:16]]), repeats),
            "what": "the saved state's 16 groups ahead of their step: asdict against Group.to_dict, then json",
        },
    }
    for side in sides.values():
        side["ratio_after_over_before"] = side["after"] / side["before"]
    return {"batch_bytes": len(wire), "samples": len(samples), **sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {
        "what": __doc__.splitlines()[0],
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **measure(args.repeats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for key in ("encode_batch", "decode_batch", "state_groups"):
        side = results[key]
        print(
            f"{key}: {side['before']:.4f} s → {side['after']:.4f} s ({side['ratio_after_over_before']:.2f}×)"
        )


if __name__ == "__main__":
    main()

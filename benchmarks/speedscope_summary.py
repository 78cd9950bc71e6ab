"""Where each process spent a py-spy recording, window by window: a text summary of a speedscope file.

`benchmarks/loop_throughput.py --profile-startup S` records `tidal rl` and every process under it with
py-spy (idle threads included) into `<run>/startup.speedscope.json`. This prints, for every thread with at
least `--min-s` seconds of samples, its command line and, per window of `--window-s` seconds, the stacks it
was in most often (their innermost frames): e.g. an engine process importing for 15 s, then compiling.

    python benchmarks/speedscope_summary.py startup.speedscope.json --window-s 5 --frames 4

`--busy` prints instead, for every thread, the share of its samples that were not waiting (innermost frame
not one of the blocking calls in WAITS: a selector, a poll, a queue or condition wait, or an event loop's
`run` with nothing on top, which is where uvloop idles) and its most frequent innermost frames: which process
was the busy one while the engine generated (loop_throughput.py --profile-from).
"""

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def frame_text(frame: dict[str, Any]) -> str:
    name = Path(frame.get("file") or "").name
    return f"{frame['name']} ({name}:{frame.get('line', 0)})" if name else str(frame["name"])


def windows(
    samples: Sequence[Sequence[int]], weights: Sequence[float], width: float
) -> list[list[tuple[int, ...]]]:
    """The samples cut into consecutive windows of `width` seconds of recorded time (py-spy --idle records
    every interval, so recorded time is wall time)."""
    out: list[list[tuple[int, ...]]] = [[]]
    elapsed = 0.0
    for stack, weight in zip(samples, weights, strict=True):
        if elapsed >= width * len(out):
            out.append([])
        out[-1].append(tuple(stack))
        elapsed += weight
    return out


def is_process(frame: dict[str, Any]) -> bool:
    """py-spy's --subprocesses puts each ancestor process in the stack as a frame `process PID:"cmdline"`."""
    return not frame.get("file") and str(frame["name"]).startswith("process ")


WAITS = frozenset({
    "select", "poll", "wait", "Condition.wait", "Queue.get", "Runner.run", "Event.wait", "Poller.poll",
    "EpollSelector.select", "_PollLikeSelector.select", "_worker", "main", "sleep", "Popen._try_wait",
    # tidal's polling loops, whose time.sleep (C) leaves them innermost
    "wait_healthy", "DeathWatch.wait", "wait_for_gate", "FilesystemReceiver.receive",
    "Connection._recv",  # a worker process waiting on its pipe (the reward pool's)
})  # fmt: skip
"""Innermost frames that mean the thread was blocked, not computing (py-spy --idle records them too)."""


def busy(
    profile: dict[str, Any], frames: list[dict[str, Any]], top: int, skip_s: float = 0.0
) -> tuple[float, list[str]]:
    """(share of samples not in a WAITS frame, the `top` innermost frames of the busy ones with their share),
    after the thread's first `skip_s` recorded seconds."""
    inner: Counter[str] = Counter()
    total = elapsed = 0.0
    for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
        elapsed += weight
        if elapsed <= skip_s:
            continue
        code = [i for i in stack if not is_process(frames[i])]
        total += weight
        name = str(frames[code[-1]]["name"]) if code else "?"
        if name not in WAITS:
            inner[name] += weight
    shown = [f"    {w / total:4.0%}  {name}" for name, w in inner.most_common(top)] if total else []
    return (sum(inner.values()) / total if total else 0.0), shown


def summarise(
    profile: dict[str, Any], frames: list[dict[str, Any]], width: float, depth: int, top: int
) -> list[str]:
    lines = []
    for index, window in enumerate(windows(profile["samples"], profile["weights"], width)):
        code = (tuple(i for i in stack if not is_process(frames[i])) for stack in window)
        counts = Counter(stack[-depth:] for stack in code)
        for stack, count in counts.most_common(top):
            share = count / max(1, len(window))
            text = " < ".join(frame_text(frames[i]) for i in reversed(stack))
            lines.append(f"  {index * width:5.0f}-{(index + 1) * width:<4.0f}s {share:4.0%}  {text}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--frames", type=int, default=4, help="innermost frames shown per stack")
    parser.add_argument("--top", type=int, default=2, help="stacks shown per window")
    parser.add_argument(
        "--min-s", type=float, default=2.0, help="threads with less recorded time are left out"
    )
    parser.add_argument("--busy", action="store_true", help="each thread's busy share and busiest frames")
    parser.add_argument("--skip-s", type=float, default=0.0, help="--busy: leave each thread's first S s out")
    args = parser.parse_args(argv)
    data = json.loads(args.file.read_text())
    frames = data["shared"]["frames"]
    for profile in data["profiles"]:
        total = sum(profile["weights"])
        if total < args.min_s or not profile["samples"]:
            continue
        owner = [frames[i]["name"] for i in profile["samples"][0] if is_process(frames[i])]
        print(f"{profile['name']} — {total:.0f} s recorded — {(owner[-1] if owner else '?')[:160]}")
        if args.busy:
            share, shown = busy(profile, frames, args.top, args.skip_s)
            print(f"  busy {share:.0%}")
            print("\n".join(shown))
        else:
            print("\n".join(summarise(profile, frames, args.window_s, args.frames, args.top)))


if __name__ == "__main__":
    main()

"""The py-spy summary's arithmetic: windows of recorded time, process frames kept out of the stacks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchmarks.speedscope_summary import busy, summarise, windows  # noqa: E402

FRAMES = [
    {"name": 'process 7:"python -m tidal rl"', "file": "", "line": 0},
    {"name": "import_vllm", "file": "/x/vllm/__init__.py", "line": 3},
    {"name": "capture", "file": "/x/vllm/worker.py", "line": 9},
    {"name": "Runner.run", "file": "/x/asyncio/runners.py", "line": 118},
]


def test_windows_cut_the_samples_by_recorded_time() -> None:
    cut = windows([[0, 1]] * 5, [0.4] * 5, width=1.0)
    assert [len(w) for w in cut] == [3, 2]  # 0, 0.4, 0.8 | 1.2, 1.6


def test_summary_shows_code_frames_innermost_first_with_their_share() -> None:
    profile = {"samples": [[0, 1]] * 3 + [[0, 1, 2]], "weights": [1.0] * 4}
    lines = summarise(profile, FRAMES, width=2.0, depth=3, top=2)
    assert lines[0].split() == ["0-2", "s", "100%", "import_vllm", "(__init__.py:3)"]
    assert len(lines) == 3 and all("2-4" in line and "50%" in line for line in lines[1:])
    assert "capture (worker.py:9) < import_vllm (__init__.py:3)" in lines[2]
    assert not any("process 7" in line for line in lines)


def test_busy_counts_samples_outside_blocking_frames_after_the_skipped_start() -> None:
    # 2 s importing (skipped), then 1 s idle in the event loop and 3 s capturing
    profile = {"samples": [[0, 1]] * 2 + [[0, 3]] + [[0, 3, 2]] * 3, "weights": [1.0] * 6}
    share, shown = busy(profile, FRAMES, top=2, skip_s=2.0)
    assert share == 0.75
    assert shown == ["     75%  capture"]
    assert busy(profile, FRAMES, top=2)[0] == 5 / 6  # with the imports

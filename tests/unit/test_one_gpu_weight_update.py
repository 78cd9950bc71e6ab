"""The one-GPU weight-update benchmark's reading of metrics and logs (its runs need a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling import

from benchmarks.one_gpu_weight_update import engine_load_ms, load_seconds, parse_args, summary  # noqa: E402


def test_load_seconds_are_per_update_after_the_warm_up() -> None:
    rows = [
        {"step": 0, "weights/updates_total": 0, "time/weight_updates_total": 0.0},
        {"step": 1, "weights/updates_total": 1, "time/weight_updates_total": 0.9},
        {"step": 2, "weights/updates_total": 2, "time/weight_updates_total": 0.95},
        {"step": 3, "weights/updates_total": 4, "time/weight_updates_total": 1.05},
    ]
    assert load_seconds(rows, skip=1) == pytest.approx([0.05, 0.05])
    assert summary([]) == {"median": None, "mean": None, "max": None, "n": 0}


def test_engine_lines_are_read_from_the_vllm_log() -> None:
    log = (
        "INFO tidal cuda_ipc: loaded step 1 in 80.5 ms\n"
        "(EngineCore pid=7) INFO tidal cuda_ipc: loaded step 3 (announced: step 2) in 12.0 ms\n"
    )
    assert engine_load_ms(log, skip=1) == [12.0]
    assert parse_args(["--backends", "filesystem,cuda_ipc"]).backends == "filesystem,cuda_ipc"

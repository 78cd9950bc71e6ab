"""Shared pytest setup: skip `gpu` tests without CUDA, helpers to run the real `tidal` CLI."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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

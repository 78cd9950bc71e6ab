"""Shared pytest setup: skip `gpu` tests without CUDA, test groups under xdist, helpers to run the `tidal` CLI."""

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


SERVER_PAIR_GROUP = "server_pair"
SERVER_PAIR_FILES = {
    "test_code_example",
    "test_custom_env",
    "test_debug_configs",
    "test_disaggregation",
    "test_envs_rollouts",
    "test_eval",
    "test_inference_client",
    "test_inference_server",
    "test_reward_workers",
}
"""Integration files with tests that use tests/integration/conftest.py's session-scoped vLLM server pair."""

HEAVIEST_FIRST = [
    "test_restarts",
    "test_rl",
    "test_slurm",
    "test_real_tokenizer",
    SERVER_PAIR_GROUP,
    "test_reverse_text_example",
    "test_lora",
    "test_multiturn_rl",
    "test_sft",
]
"""Groups that take minutes, roughly longest first (seconds in a `make test` run on the 2-core CI machine,
two at once: ~260, ~450, ~250, ~300 (estimated), ~200, ~200, ~120, ~60, ~160). The scheduler hands groups out in collection
order, so starting the long ones first keeps one worker from being left with a long group at the end while
the other idles."""


def group_of(nodeid: str) -> str | None:
    """The group a test runs in under `pytest -n 2` (`make test`): a group runs on one worker, one test after
    another; None for a test free to go wherever a worker is idle (the unit tests). An integration file is
    one group, because its module-scoped fixtures (a whole RL run, a Slurm cluster) would otherwise run once
    on each worker that gets one of its tests; and the files that use the shared server pair are one group,
    because a session fixture starts once per worker (and its two servers are pinned to cores 0 and 1)."""
    path = Path(nodeid.split("::", 1)[0])
    if path.parent.name != "integration":
        return None
    return SERVER_PAIR_GROUP if path.stem in SERVER_PAIR_FILES else path.stem


def _rank(item: pytest.Item) -> int:
    group = group_of(item.nodeid)
    if group in HEAVIEST_FIRST:
        return HEAVIEST_FIRST.index(group)
    return len(HEAVIEST_FIRST) + (0 if group is not None else 1)  # then other integration files, then units


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: only called when it distributes the tests
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Tests of one `group_of` go to one worker, groups in collection order. xdist's own `--dist loadgroup`
    would do this from `xdist_group` marks, but pytest 9 ignores the test-id suffix that xdist 3.8 writes
    for them (Node.nodeid comes from `_id` now): every test then went to any worker."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    config.option.loadscopereorder = False  # keep the collection order (longest groups first)
    return GroupScheduling(config, log)


_AFFINITY: dict[str, set[int]] = {}
"""Under xdist: the machine's cores (`every`) and this worker's (`share`), set by pytest_configure."""


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker on cores of its own (its share of the machine's), which every process its
    tests start inherits: tidal sizes its threads and vLLM's core binding from the process's cores
    (`tidal.config.deployment.usable_cores`), so two tests side by side no longer each take every core.
    Oversubscribed, a CPU trainer's threads wait on one another at every parallel region (the reverse_text
    example's steps took 3-8x longer beside another test)."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")),
    )
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    from tidal.config.deployment import usable_cores

    cores = usable_cores()
    if len(cores) < count:
        return
    index = int(worker.removeprefix("gw")) % count
    share = set(cores[index * len(cores) // count : (index + 1) * len(cores) // count])
    _AFFINITY.update(every=set(cores), share=share)
    os.sched_setaffinity(0, share)
    if "torch" in sys.modules:  # its thread pool may have been sized from every core already
        sys.modules["torch"].set_num_threads(len(share))


@contextlib.contextmanager
def _cpu_turn(alone: bool) -> Iterator[None]:
    """Under xdist: hold the run's test lock shared, or exclusive for a test marked `alone` (timing asserts that
    a test beside it broke: an event-loop lag of 0.51 s against the bound of 0.3 while the other worker
    trained). The gate makes a test that waits to run alone hold back the next tests of other workers, which
    would otherwise keep the shared lock taken."""
    run = Path(tempfile.gettempdir()) / f"tidal-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    with open(f"{run}.gate", "a") as gate, open(f"{run}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of each test within its turn (fixtures that start processes included)."""
    if not os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    with _cpu_turn(alone), _every_core(alone):
        return (yield)


@contextlib.contextmanager
def _every_core(alone: bool) -> Iterator[None]:
    """A test that runs alone gets every core back for the processes it starts (its timing asserts were set
    with the machine to itself), and the worker its own share after."""
    if not alone or not _AFFINITY:
        yield
        return
    os.sched_setaffinity(0, _AFFINITY["every"])
    try:
        yield
    finally:
        os.sched_setaffinity(0, _AFFINITY["share"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "server_pair" in getattr(item, "fixturenames", ()) and group_of(item.nodeid) != SERVER_PAIR_GROUP:
            raise pytest.UsageError(f"{item.nodeid} uses the server pair: add its file to SERVER_PAIR_FILES")
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

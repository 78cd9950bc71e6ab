"""Supervised process groups: stopping a group whose leader is dead, and the order in which processes end.

Real (tiny) processes: `sh` and `sleep`, no model and no server.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.inference.server import ServerProcess
from tidal.process import (
    STOP_GRACE,
    DeathWatch,
    ManagedProcess,
    ProcInfo,
    descendants,
    finish_groups,
    group_alive,
    process_table,
    stop_together,
    terminate_groups,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")


def _leader_with_a_worker() -> tuple[subprocess.Popen[bytes], int]:
    """A group leader (like vLLM's API server) with a worker in its group (like the engine core)."""
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 61"], start_new_session=True)
    deadline = time.monotonic() + 5
    while not descendants(leader.pid, process_table()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.02)
    [worker] = descendants(leader.pid, process_table())
    return leader, worker


@pytest.mark.alone  # stopped within 2 s
def test_a_group_whose_leader_was_killed_is_stopped_at_once():
    """SIGKILL of the leader leaves its worker running (orphaned); stopping the group must SIGTERM it right
    away, not wait out the grace period first (vLLM's engine outlived a killed server by 20 s)."""
    leader, worker = _leader_with_a_worker()
    pgid = os.getpgid(leader.pid)
    leader.kill()
    leader.wait()
    assert group_alive(pgid)  # the worker runs on
    start = time.monotonic()
    terminate_groups([pgid])
    code = finish_groups(leader, [pgid], deadline=start + 10.0)
    assert time.monotonic() - start < 2.0
    assert code == -signal.SIGKILL
    assert not group_alive(pgid)
    assert worker not in process_table() or process_table()[worker].state in "ZX"


@pytest.mark.alone  # stopped within 2 s
def test_managed_process_stops_the_groups_it_adopted_even_after_it_died(tmp_path: Path):
    """The launcher's `tidal inference` child starts vLLM in a session of its own: when the child is gone,
    stopping it still stops that session."""
    script = (
        "import subprocess, time; subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    )
    child = ManagedProcess("inference", [sys.executable, "-c", script], tmp_path / "child.log").start()
    assert child.pid is not None
    deadline = time.monotonic() + 10
    while not descendants(child.pid, process_table()):
        assert time.monotonic() < deadline, "the grandchild did not start"
        time.sleep(0.05)
    [grandchild] = child.adopt_descendants()
    other_group = os.getpgid(grandchild)
    assert child.groups == [child.pid, other_group]
    os.kill(child.pid, signal.SIGKILL)  # the grandchild is now an orphan in its own session
    start = time.monotonic()
    child.stop()
    assert time.monotonic() - start < 2.0
    assert not group_alive(other_group)


@pytest.mark.alone  # stop times within 1.9-3.9 s
def test_stop_together_stops_children_side_by_side(tmp_path: Path):
    """Two children that each take 2 s to stop after SIGTERM: stopped together it takes about 2 s, not the
    4 s of one after the other, and each child's stop time is recorded."""
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2.0), sys.exit(3)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    children = [
        ManagedProcess(name, [sys.executable, "-c", script], tmp_path / f"{name}.log").start()
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 20
    while not all("ready" in c.log_path.read_text() for c in children):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    start = time.monotonic()
    stop_together(children, grace=10.0)
    took = time.monotonic() - start
    assert [c.poll() for c in children] == [3, 3]  # each stopped itself (no SIGKILL)
    assert all(c.stop_seconds is not None and 1.9 < c.stop_seconds < 3.9 for c in children)
    assert took < 3.9, took  # one after the other: at least 4 s


def test_death_watch_records_the_order_processes_end_in_grandchildren_included():
    leader, worker = _leader_with_a_worker()  # the worker is a grandchild of this test's process
    other = subprocess.Popen(["sleep", "60"])
    watch = DeathWatch()
    for pid in (leader.pid, worker, other.pid):
        watch.watch(pid)
    try:
        os.kill(worker, signal.SIGKILL)
        watch.wait(2.0)
        time.sleep(0.05)
        other.kill()
        deadline = time.monotonic() + 5
        while other.pid not in watch.ended and time.monotonic() < deadline:
            watch.wait(0.5)
        assert set(watch.ended) == {worker, other.pid}  # the leader still runs
        assert watch.ended[worker] < watch.ended[other.pid]
    finally:
        watch.close()
        for proc in (leader, other):
            proc.kill()
            proc.wait()


def test_descendants_walks_the_process_table():
    table = {
        10: ProcInfo(ppid=1, pgid=10, state="S"),
        11: ProcInfo(ppid=10, pgid=11, state="S"),
        12: ProcInfo(ppid=11, pgid=11, state="S"),
        13: ProcInfo(ppid=1, pgid=13, state="S"),
    }
    assert descendants(10, table) == [11, 12]
    assert descendants(13, table) == []


def test_inner_stop_grace_is_shorter_than_the_launchers():
    """`tidal inference` must be done stopping vLLM before the launcher gives up on it and SIGKILLs it."""
    import inspect

    inner = inspect.signature(ServerProcess.stop).parameters["grace"].default
    outer = inspect.signature(ManagedProcess.stop).parameters["grace"].default
    assert outer == STOP_GRACE and inner < outer


def test_a_servers_ipc_sockets_go_in_a_folder_of_its_own_removed_when_it_stops(tmp_path: Path, monkeypatch):
    """vLLM makes its ZMQ sockets as /tmp/<uuid> and never removes them: ServerProcess points them into a
    folder of its own (VLLM_RPC_BASE_PATH) and removes it at stop; a path the user set is left alone."""
    from tidal.inference.server import RPC_BASE_ENV, Launch

    monkeypatch.delenv(RPC_BASE_ENV, raising=False)
    # stands in for vLLM: a socket-like file where it is told to make them, then wait to be stopped
    script = f"import os, time; open(os.path.join(os.environ[{RPC_BASE_ENV!r}], 'sock'), 'w'); time.sleep(60)"
    launch = Launch(argv=[sys.executable, "-c", script], env={}, url="http://127.0.0.1:1")
    server = ServerProcess(launch).start()
    ipc_dir = Path(str(server.ipc_dir))
    assert appears(ipc_dir / "sock")
    server.stop(grace=2)
    assert not ipc_dir.exists() and server.ipc_dir is None

    monkeypatch.setenv(RPC_BASE_ENV, str(tmp_path))  # the user's choice: kept, nothing removed
    server = ServerProcess(launch).start()
    assert server.ipc_dir is None
    assert appears(tmp_path / "sock")
    server.stop(grace=2)
    assert (tmp_path / "sock").exists()


def appears(path: Path, timeout: float = 20.0) -> bool:
    """Whether `path` exists within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()

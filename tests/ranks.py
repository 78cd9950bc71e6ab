"""Helpers for tests that start real processes: a free loopback port, and gloo ranks spawned together.

`run_ranks` starts `world` spawned processes of `target(rank, world, *args, port, failures)`; a worker puts
its traceback on `failures` instead of raising, so the test fails with every rank's error, not a hang.
"""

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 240) -> None:
    """Run `target` on `world` ranks (one rendezvous port) and fail with what any rank reported."""
    context = mp.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=target, args=(rank, world, *args, port, failures)) for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    problems = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not problems, "\n".join(problems)
    assert [proc.exitcode for proc in procs] == [0] * world

"""The reward worker pool: real worker processes running the module-level reward functions defined here."""

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from tidal.envs.base import Episode, SingleTurnEnv, Task, rewards_run_by, score_episode
from tidal.envs.reward_pool import RewardPool, RewardWorkerDied, reward_workers
from tidal.orchestrator.lag import LoopLagMonitor

TASK = Task(task_id="t/0", messages=[{"role": "user", "content": "hi"}], answer="abc")
EPISODE = Episode(
    prompt_ids=[1, 2], completion_ids=[3, 4, 5], messages=[{"role": "assistant", "content": "abc"}]
)


def completion_length(task: Task, episode: Episode) -> float:
    return float(len(episode.completion_ids) + len(task.answer))


def worker_pid(task: Task, episode: Episode) -> float:
    return float(os.getpid())


def raises(task: Task, episode: Episode) -> float:
    raise ValueError("the judge refused")


class NeedsTwoArguments(Exception):
    def __init__(self, a: str, b: str):
        super().__init__(f"{a} {b}")


def raises_unpicklable(task: Task, episode: Episode) -> float:
    raise NeedsTwoArguments("half", "baked")


def hangs(task: Task, episode: Episode) -> float:
    time.sleep(60)
    return 0.0


def exits(task: Task, episode: Episode) -> float:
    os._exit(3)


def segfaults(task: Task, episode: Episode) -> float:
    ctypes.string_at(0)
    return 0.0


def burns_a_second(task: Task, episode: Episode) -> float:
    start = time.process_time()
    while time.process_time() - start < 1.0:
        pass
    return float(os.getpid())


def alarm_works(task: Task, episode: Episode) -> float:
    """What math-verify's timeouts need: signal.alarm, possible only in a process's main thread."""
    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
    signal.alarm(0)
    return 1.0


async def async_pid(task: Task, episode: Episode) -> float:
    return float(os.getpid())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def with_pool(work, num_workers: int = 1):
    pool = RewardPool(num_workers)
    try:
        return await work(pool)
    finally:
        await pool.close()


def test_a_reward_runs_in_a_worker_and_its_value_comes_back():
    async def work(pool):
        return await pool.run(completion_length, TASK, EPISODE), await pool.run(worker_pid, TASK, EPISODE)

    length, pid = run(with_pool(work))
    assert length == 6.0
    assert pid != os.getpid()


def test_signal_alarm_works_in_the_worker():
    assert run(with_pool(lambda pool: pool.run(alarm_works, TASK, EPISODE))) == 1.0


def test_an_exception_of_the_reward_reaches_the_caller_with_its_type_and_the_worker_stays():
    async def work(pool):
        with pytest.raises(ValueError, match="the judge refused"):
            await pool.run(raises, TASK, EPISODE)
        before = pool.pids()
        with pytest.raises(Exception, match="half baked") as info:
            await pool.run(raises_unpicklable, TASK, EPISODE)
        assert type(info.value).__name__ == "NeedsTwoArguments"  # failures are counted by type name
        assert await pool.run(completion_length, TASK, EPISODE) == 6.0
        assert pool.pids() == before

    run(with_pool(work))


def test_a_timed_out_call_kills_its_worker_and_a_replacement_serves_the_next_call():
    async def work(pool):
        first = int(await pool.run(worker_pid, TASK, EPISODE))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.run(hangs, TASK, EPISODE), 0.5)
        second = int(await pool.run(worker_pid, TASK, EPISODE))
        assert second != first and not alive(first)
        assert pool.pids() == [second]

    run(with_pool(work))


@pytest.mark.parametrize(("reward", "how"), [(exits, "exit code 3"), (segfaults, "killed by SIGSEGV")])
def test_a_crashing_worker_fails_only_its_call_and_is_replaced(reward, how):
    async def work(pool):
        calls = [pool.run(reward, TASK, EPISODE), pool.run(completion_length, TASK, EPISODE)]
        crashed, fine = await asyncio.gather(*calls, return_exceptions=True)
        assert (
            isinstance(crashed, RewardWorkerDied) and how in str(crashed) and reward.__name__ in str(crashed)
        )
        assert fine == 6.0
        assert await pool.run(completion_length, TASK, EPISODE) == 6.0

    run(with_pool(work, num_workers=2))


def test_close_leaves_no_worker_alive_even_one_in_a_call():
    async def work():
        pool = RewardPool(2)
        await asyncio.gather(pool.run(worker_pid, TASK, EPISODE), pool.run(worker_pid, TASK, EPISODE))
        hanging = asyncio.ensure_future(pool.run(hangs, TASK, EPISODE))
        await asyncio.sleep(0.3)
        pids = pool.pids()
        assert len(pids) >= 2 and all(alive(pid) for pid in pids)
        await pool.close()
        with pytest.raises(RewardWorkerDied):
            await hanging
        return pids

    pids = run(work())
    assert not any(alive(pid) for pid in pids)


def test_workers_die_when_their_parent_is_sigkilled(tmp_path):
    script = textwrap.dedent(
        """
        import asyncio, sys, time
        from tests.unit.test_reward_pool import EPISODE, TASK, hangs, worker_pid
        from tidal.envs.reward_pool import RewardPool

        async def main():
            pool = RewardPool(2)
            await asyncio.gather(pool.run(worker_pid, TASK, EPISODE), pool.run(worker_pid, TASK, EPISODE))
            asyncio.ensure_future(pool.run(hangs, TASK, EPISODE))  # one busy, one idle worker
            await asyncio.sleep(0.5)
            print(*pool.pids(), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    assert_workers_die_with_parent(script, 2)


def assert_workers_die_with_parent(script: str, count: int) -> None:
    """Run `script` (it prints its `count` workers' pids on one line, then waits), SIGKILL it: every one of
    them ends within 10 s."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == count and all(alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.alone  # lag < 0.3 s
def test_the_event_loop_keeps_ticking_while_a_cpu_bound_reward_runs():
    async def work(pool):
        await pool.run(worker_pid, TASK, EPISODE)  # the worker is up: its start is not measured
        monitor = LoopLagMonitor(interval=0.01)
        monitor.start()
        pid = await pool.run(burns_a_second, TASK, EPISODE)
        await monitor.stop()
        return pid, monitor.take()

    pid, lags = run(with_pool(work))
    assert pid != os.getpid()
    assert len(lags) > 20 and max(lags) < 0.3


def test_rewards_that_cannot_be_sent_run_inline_with_one_warning(caplog):
    counted = []

    def closure(task: Task, episode: Episode) -> float:
        counted.append(1)
        return float(os.getpid())

    async def work(pool):
        return [await pool.run(fn, TASK, EPISODE) for fn in (closure, closure, lambda t, e: 2.0)]

    with caplog.at_level(logging.WARNING, logger="tidal.envs.reward_pool"):
        values = run(with_pool(work))
    assert values == [float(os.getpid()), float(os.getpid()), 2.0] and counted == [1, 1]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "'closure'" in warnings[0] and "event loop" in warnings[0] and "'<lambda>'" in warnings[1]


class PidEnv(SingleTurnEnv):
    name = "pids"

    def num_tasks(self) -> int:
        return 1

    def task(self, index: int) -> Task:
        return TASK


def test_environment_score_sends_plain_rewards_to_the_pool_and_keeps_async_ones_on_the_loop():
    env = PidEnv(rewards=[(worker_pid, 1.0), (async_pid, 0.0)])

    async def work():
        async with reward_workers(1) as pool:
            assert pool is not None
            episode = await score_episode(env, TASK, Episode(prompt_ids=[1]))
            return episode.metrics, pool.pids()

    metrics, pids = run(work())
    assert metrics["reward/worker_pid"] == float(pids[0]) != float(os.getpid())
    assert metrics["reward/async_pid"] == float(os.getpid())
    assert not alive(pids[0])


def test_no_pool_and_zero_workers_run_rewards_inline():
    env = PidEnv(rewards=[(worker_pid, 1.0)])

    async def work():
        async with reward_workers(0) as pool:
            assert pool is None
            return (await score_episode(env, TASK, Episode(prompt_ids=[1]))).reward

    assert run(work()) == float(os.getpid())
    with rewards_run_by(None):
        assert run(score_episode(env, TASK, Episode(prompt_ids=[1]))).reward == float(os.getpid())


def test_a_reward_the_worker_cannot_import_runs_inline_with_one_warning(caplog, monkeypatch):
    module = types.ModuleType("tidal_test_only_here")  # importable in this process only

    def only_here(task: Task, episode: Episode) -> float:
        return float(os.getpid())

    only_here.__module__ = module.__name__
    only_here.__qualname__ = "only_here"
    module.only_here = only_here  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)

    async def work(pool):
        return [await pool.run(only_here, TASK, EPISODE) for _ in range(2)]

    with caplog.at_level(logging.WARNING, logger="tidal.envs.reward_pool"):
        assert run(with_pool(work)) == [float(os.getpid())] * 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'only_here'" in warnings[0] and "could not load" in warnings[0], warnings


def test_a_worker_killed_from_outside_is_replaced_and_told_as_a_failure_and_a_recovery():
    """What issue 14's chaos test does to an environment worker: SIGKILL while idle, then while it computes."""
    events = []

    async def work(pool):
        first = int(await pool.run(worker_pid, TASK, EPISODE))
        os.kill(first, signal.SIGKILL)
        while alive(first):
            await asyncio.sleep(0.01)
        second = int(await pool.run(worker_pid, TASK, EPISODE))  # the replacement serves it
        running = asyncio.create_task(pool.run(hangs, TASK, EPISODE))
        await asyncio.sleep(0.5)
        os.kill(second, signal.SIGKILL)
        with pytest.raises(RewardWorkerDied):
            await running
        assert await pool.run(completion_length, TASK, EPISODE) == 6.0
        return first, second

    async def go():
        pool = RewardPool(1, on_event=lambda event, **fields: events.append((event, fields)))
        try:
            return await work(pool)
        finally:
            await pool.close()

    first, second = run(go())
    assert [event for event, _ in events] == ["failure", "recovery", "failure", "recovery"]
    assert events[0][1]["pid"] == first and "died while idle" in events[0][1]["cause"]
    assert events[2][1]["pid"] == second and "died running 'hangs'" in events[2][1]["cause"]
    assert all(fields["seconds_lost"] >= 0 for event, fields in events if event == "recovery")

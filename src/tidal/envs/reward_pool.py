"""Reward workers: synchronous reward functions run in separate processes, off the caller's event loop.

The orchestrator runs every rollout as a task on one asyncio loop; a reward that computes for a second
(math-verify, a rubric, a test suite) would hold every request in flight for that second. `RewardPool` sends
`(fn, task, episode)` to one of N worker processes and awaits the answer on the loop (the reply pipe is
watched with `loop.add_reader`: no thread, no blocking wait). Each worker runs one call at a time in its main
thread, so rewards that time themselves out with `signal.alarm` (math-verify) work there.

Workers are spawned (not forked: the orchestrator has tokenizer and HTTP threads, and a fork copies their
locks held). A call whose caller is cancelled (the rollout timed out, or the step no longer needs it) kills
its worker, and a worker that dies (segfault, `os._exit`) fails only the call it was running; either way a
replacement starts. Workers die with the process that started them (parent-death signal, and EOF on their
pipe); `close()` kills what is left. A spawned worker imports the parent's `__main__` module first, so a
script that runs an orchestrator or an eval itself needs the `if __name__ == "__main__":` guard (the
`tidal` command has it).

Only functions that pickle by reference are sent: module-level functions, or `functools.partial` of one.
Anything else (a lambda, a closure, a bound method or a callable object, whose changes to itself would be
lost in a copy) runs inline on the event loop, with one warning naming it.
"""

import asyncio
import contextlib
import functools
import inspect
import logging
import multiprocessing
import os
import pickle
import signal
import time
import types
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tidal.config.deployment import usable_cores
from tidal.envs.base import (
    Episode,
    RewardFn,
    Task,
    call_inline,
    reward_name,
    reward_runner,
    rewards_run_by,
)
from tidal.process import exit_with_parent

logger = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 4
EXIT_WAIT = 2.0
"""Seconds to wait for a killed (or crashed) worker's exit status before giving up on reaping it."""


class RewardWorkerDied(RuntimeError):
    """The worker process running a reward call died (crash, signal, `os._exit`): that call fails."""


def default_num_workers() -> int:
    """Reward workers when `reward_workers` is unset: one per CPU core this process may use, at most 4."""
    return min(MAX_DEFAULT_WORKERS, len(usable_cores()))


def unsendable(fn: RewardFn) -> str | None:
    """Why `fn` must run inline rather than in a worker; None when it can be sent (pure)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.ismethod(target):
        return (
            "a bound method would run on a copy of its object in the worker (what it changes would be lost)"
        )
    if not isinstance(target, types.FunctionType):
        return "a callable object would run on a copy of itself in the worker (what it changes would be lost)"
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - pickle raises several types for the same problem
        return f"it cannot be sent to another process ({type(exc).__name__}: {exc})"
    return None


WorkerEvent = Callable[..., None]
"""Told of each worker that died, `("failure", pid=…, cause=…, action=…)`, and of its replacement once it
runs, `("recovery", seconds_lost=…)` (the orchestrator writes them to events.jsonl)."""


class RewardPool:
    """Up to `num_workers` worker processes, started on first use; `await run(fn, task, episode)`."""

    def __init__(self, num_workers: int, on_event: WorkerEvent | None = None):
        if num_workers < 1:
            raise ValueError("a reward pool needs at least one worker")
        self.num_workers = num_workers
        self._context = multiprocessing.get_context("spawn")
        # Workers are started from this one thread, off the loop (starting one takes milliseconds, more on a
        # busy machine). It lives as long as the pool, which matters: Linux sends the parent-death signal
        # when the *thread* that started a child exits.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-reward-starter")
        self._idle: asyncio.Queue[_Worker | BaseException] = asyncio.Queue()
        self._num_started = 0  # alive or starting, idle or busy
        self._workers: set[_Worker] = set()
        self._background: set[asyncio.Task[None]] = set()
        # id → fn (held, so that the id is not reused): functions checked once, then sent or run inline
        self._sendable: dict[int, RewardFn] = {}
        self._inline: dict[int, RewardFn] = {}
        self._closed = False
        self._on_event = on_event
        self._deaths: list[float] = []  # when (monotonic) each dead worker not replaced yet was found dead

    async def run(self, fn: RewardFn, task: Task, episode: Episode) -> float:
        """`float(fn(task, episode))`, computed in a worker; an exception of the reward is raised here."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        if not self._sends(fn):
            return await call_inline(fn, task, episode)
        try:
            reply = await self._call(fn, (task, episode), as_reward=True)
        except _CannotSend as exc:
            self._run_inline(fn, f"its task or episode cannot be sent to a worker ({exc})")
            return await call_inline(fn, task, episode)
        kind, value = pickle.loads(reply)
        if kind == "unloadable":
            self._run_inline(fn, f"a worker could not load it ({value}); is its module importable there?")
            return await call_inline(fn, task, episode)
        return float(_result(kind, value))

    async def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` computed in a worker, for work whose result is more than a reward (a test report):
        any picklable value comes back; an exception of `fn` is raised here. `fn` must be a module-level
        function (TypeError otherwise, or when an argument cannot be sent)."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        problem = unsendable(fn)
        if problem is not None:
            raise TypeError(f"{reward_name(fn)!r} cannot run in a reward worker: {problem}")
        try:
            reply = await self._call(fn, args, as_reward=False)
        except _CannotSend as exc:
            raise TypeError(
                f"the arguments of {reward_name(fn)!r} cannot be sent to a worker: {exc}"
            ) from None
        kind, value = pickle.loads(reply)
        if kind == "unloadable":
            raise TypeError(f"a reward worker could not load {reward_name(fn)!r}: {value}")
        return _result(kind, value)

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        return sorted(w.pid for w in self._workers)

    async def close(self) -> None:
        """Kill every worker and reap it; calls still running fail with `RewardWorkerDied`."""
        if self._closed:
            return
        self._closed = True
        # starts finish (each ends up in _workers, killed below) and reapers end by themselves: bounded waits
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.to_thread(self._starter.shutdown)
        workers = list(self._workers)
        for worker in workers:
            worker.kill()
            if not worker.busy:
                worker.conn.close()  # a busy one's call closes it once it stops watching it
        await asyncio.gather(*(w.reap() for w in workers))
        self._workers.clear()

    # ---- dispatch ----------------------------------------------------------------------------------

    def _sends(self, fn: RewardFn) -> bool:
        """Whether `fn` goes to a worker; the first time it cannot, that is warned."""
        if id(fn) in self._sendable:
            return True
        if id(fn) in self._inline:
            return False
        problem = unsendable(fn)
        if problem is not None:
            self._run_inline(fn, f"{problem}; a module-level function would run in a worker")
            return False
        self._sendable[id(fn)] = fn
        return True

    def _run_inline(self, fn: RewardFn, reason: str) -> None:
        self._sendable.pop(id(fn), None)
        self._inline[id(fn)] = fn
        logger.warning(
            "reward function %r runs on the event loop, not in a reward worker: %s", reward_name(fn), reason
        )

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], as_reward: bool) -> bytes:
        """The pickled reply of a worker to `fn(*args)`; `_CannotSend` when the call does not pickle."""
        name = reward_name(fn)
        worker = await self._acquire()
        try:
            # pickled only once a worker is free: a burst of finished rollouts is then spread over the
            # loop's iterations instead of all pickled in one
            payload = pickle.dumps((fn, args, as_reward), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable object in episode.info
            self._idle.put_nowait(worker)
            raise _CannotSend(f"{type(exc).__name__}: {exc}") from None
        worker.busy = True
        try:
            reply = await worker.call(payload)
        except RewardWorkerDied:
            self._retire(worker, died=f"died running {name!r}; that rollout failed")
            code = await worker.exit_code()
            logger.warning("reward worker %d died running %r (%s); starting another", worker.pid, name, code)
            raise RewardWorkerDied(f"the reward worker running {name!r} died ({code})") from None
        except BaseException:  # cancelled (the rollout timed out or is not needed): the worker may be stuck
            self._retire(worker)
            logger.info("reward worker %d killed: its call of %r was cancelled", worker.pid, name)
            raise
        worker.busy = False
        self._idle.put_nowait(worker)
        return reply

    async def _acquire(self) -> "_Worker":
        if self._idle.empty() and self._num_started < self.num_workers:
            self._start_one()
        while True:
            item = await self._idle.get()
            if isinstance(item, BaseException):
                raise item  # that start failed; the next call tries again
            if item.alive():
                return item
            self._retire(item, died="died while idle")  # killed from outside: try the replacement

    def _start_one(self) -> None:
        self._num_started += 1
        self._spawn_task(self._start())

    async def _start(self) -> None:
        try:
            worker = await asyncio.get_running_loop().run_in_executor(
                self._starter, _Worker.start, self._context, os.getpid()
            )
        except Exception as exc:  # noqa: BLE001 - e.g. no more processes allowed
            self._num_started -= 1
            logger.error("could not start a reward worker: %s: %s", type(exc).__name__, exc)
            self._idle.put_nowait(RuntimeError(f"could not start a reward worker: {exc}"))
            return
        self._workers.add(worker)
        if self._closed:  # close() kills it
            return
        if self._deaths and self._on_event is not None:
            self._on_event("recovery", seconds_lost=round(time.monotonic() - self._deaths.pop(0), 3))
        self._idle.put_nowait(worker)

    def _retire(self, worker: "_Worker", died: str | None = None) -> None:
        """Kill `worker` (no reader watches its pipe any more), reap it in the background, replace it.
        `died`: how it ended by itself, for `on_event`."""
        if died is not None and worker in self._workers and self._on_event is not None:
            self._deaths.append(time.monotonic())
            self._on_event(
                "failure", pid=worker.pid, cause=f"reward worker {worker.pid} {died}", action="replace"
            )
        worker.kill()
        worker.conn.close()
        if worker not in self._workers:
            return  # already retired (or reaped by close)
        self._workers.discard(worker)
        self._num_started -= 1
        if self._closed:
            return
        self._spawn_task(worker.reap())
        self._start_one()

    def _spawn_task(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection):
        self.process = process
        self.conn = conn
        self.pid: int = process.pid or 0
        self.busy = False

    @staticmethod
    def start(context: Any, parent_pid: int) -> "_Worker":
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(
            target=serve, args=(theirs, parent_pid), daemon=True, name="tidal-reward-worker"
        )
        process.start()
        theirs.close()
        return _Worker(process, ours)

    async def call(self, payload: bytes) -> bytes:
        """Send one call and await its reply; the pipe is watched by the loop, never waited on."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[bytes] = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, self._on_readable, reply)
        try:
            try:
                self.conn.send_bytes(payload)  # the worker is idle in recv: it drains the pipe at once
            except OSError as exc:
                raise RewardWorkerDied(str(exc)) from None
            return await reply
        finally:
            loop.remove_reader(fd)

    def _on_readable(self, reply: "asyncio.Future[bytes]") -> None:
        if reply.done():
            return
        try:
            reply.set_result(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            reply.set_exception(RewardWorkerDied(str(exc) or type(exc).__name__))

    def alive(self) -> bool:
        return self.process.exitcode is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    async def exit_code(self) -> str:
        """How the process ended, once it has (waited for without blocking the loop)."""
        await self.reap()
        code = self.process.exitcode
        if code is None:
            return "no exit status yet"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    async def reap(self) -> None:
        """Wait (polling, up to EXIT_WAIT s) until the process has ended, collecting its exit status."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXIT_WAIT
        while self.process.exitcode is None and loop.time() < deadline:
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def reward_workers(
    num_workers: int | None, on_event: WorkerEvent | None = None
) -> AsyncIterator[RewardPool | None]:
    """Inside the block, synchronous reward functions (`call_reward`) run in a pool of `num_workers`
    processes (None: `default_num_workers()`; 0: no pool, inline on the event loop). Closed on the way out."""
    size = default_num_workers() if num_workers is None else num_workers
    if size == 0:
        yield None
        return
    pool = RewardPool(size, on_event)
    logger.info("reward functions run in up to %d worker processes", size)
    try:
        with rewards_run_by(pool):
            yield pool
    finally:
        await pool.close()


# ---- the worker process ------------------------------------------------------------------------------


def serve(conn: Connection, parent_pid: int) -> None:
    """A worker's main loop: one pickled call in, one pickled reply out, until the parent closes the pipe."""
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        reply = answer(payload)
        try:
            conn.send_bytes(reply)
        except OSError:  # the parent went away
            return


def answer(payload: bytes) -> bytes:
    """The pickled reply to one pickled `(fn, args, as_reward)`: ("ok", value), ("raised", exception),
    ("raised_unpicklable", (type name, message)) or ("unloadable", why). A reward's value is a float."""
    try:
        fn, args, as_reward = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - e.g. the function's module is not importable here
        return pickle.dumps(("unloadable", f"{type(exc).__name__}: {exc}"))
    try:
        value = fn(*args)
        if inspect.isawaitable(value):
            with contextlib.suppress(AttributeError):
                value.close()  # type: ignore[attr-defined]
            raise TypeError(f"reward function {reward_name(fn)!r} returned an awaitable; make it `async def`")
        return pickle.dumps(("ok", float(value) if as_reward else value))
    except Exception as exc:  # noqa: BLE001 - the reward's failure is the caller's to count
        return _raised(exc)
    except BaseException as exc:  # sys.exit() in a reward fails that rollout, not the orchestrator
        return pickle.dumps(("raised_unpicklable", (type(exc).__name__, str(exc))))


def _result(kind: str, value: Any) -> Any:
    """The value of an "ok" reply; the exception of a "raised" one is raised."""
    if kind == "ok":
        return value
    if kind == "raised":
        raise value
    raise _stand_in(*value)


class _CannotSend(Exception):
    """A call whose function or arguments do not pickle."""


async def call_off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` off the event loop: in a reward worker where the caller runs them (`reward_workers`), else
    in a thread. For environments whose reward needs more than a float back (`tidal.envs.code_tests`)."""
    runner = reward_runner()
    if isinstance(runner, RewardPool):
        return await runner.apply(fn, *args)
    return await asyncio.to_thread(fn, *args)


def _raised(exc: BaseException) -> bytes:
    """The exception itself when it survives pickling both ways, else its type name and message."""
    try:
        data = pickle.dumps(("raised", exc))
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt (a required __init__ argument)
        return data
    except Exception:  # noqa: BLE001
        return pickle.dumps(("raised_unpicklable", (type(exc).__name__, str(exc))))


@functools.cache
def _stand_in_type(name: str) -> type[Exception]:
    """An exception class named like one that could not be sent back: failures are counted by type name."""
    return type(name, (RuntimeError,), {"__module__": __name__})


def _stand_in(name: str, message: str) -> Exception:
    return _stand_in_type(name)(message)

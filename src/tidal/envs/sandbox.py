"""Tools for `tool_use` and the sandbox model-written code runs in: an arithmetic calculator (AST-checked,
bounded) and `PythonSandbox`.

`PythonSandbox` runs the code in a fresh `python -I -S` subprocess (the code on its stdin), in its own process
group, with rlimits on CPU time, address space, file size and process count, and a wall-clock timeout that
kills the group. Where bubblewrap works (`tidal.envs.bwrap`) the subprocess runs inside it: its own pid and
network namespaces (no network), a read-only root holding only the system directories and Python, a private
/tmp, as an unprivileged user of its own. Where it does not, the in-process limits alone are the fallback (`sandbox =
"auto"`, the default, warns once per process; `"bwrap"` requires the OS sandbox): the child runs in a
temporary directory, tries to enter new user+network namespaces, and a prelude replaces the socket
constructors. That fallback stops accidents and naive code, not a determined attacker (the code can read
whatever the user can, and ctypes can still make syscalls).
"""

import ast
import asyncio
import contextlib
import logging
import operator
import os
import signal
import sys
import tempfile
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tidal.envs import bwrap
from tidal.envs.tools import Tool, truncate

logger = logging.getLogger(__name__)
T = TypeVar("T")

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100  # bounds every intermediate so `9**9**9` cannot eat the machine


def calculate(expression: str) -> str:
    """Evaluate + - * / // % ** and parentheses over numbers; anything else is an error."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))  # type: ignore[operator]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 512:
            raise ValueError("exponent too large")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("result out of range")
    return value


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate arithmetic, e.g. (3 + 4) * 12.",
    parameters={
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression to evaluate.",
                "examples": ["(3 + 4) * 12"],
            }
        },
        "required": ["expression"],
    },
    fn=calculate,
)

SANDBOX_MODES = ("auto", "bwrap", "process")
"""`bwrap`: the OS sandbox, required (an environment that asks for it fails at construction when it cannot
run here); `process`: the in-process limits only; `auto`: bwrap where it works, else `process`, warned."""

# The fallback's network guard, first in the child: when the network namespace could not be entered, no
# socket can be created from Python.
_NO_NETWORK_PRELUDE = """
import socket as _s, _socket as _ss
def _blocked(*a, **k):
    raise OSError("network access is disabled in this sandbox")
for _m in (_s, _ss):
    for _n in ("socket", "create_connection", "socketpair", "fromfd", "create_server", "getaddrinfo"):
        if hasattr(_m, _n):
            setattr(_m, _n, _blocked)
del _s, _ss, _m, _n, _blocked
"""
# Last in the child: the code comes on stdin (nothing of it is written to the host) and runs as __main__.
_RUN_STDIN = """
import sys as _sys
_code = _sys.stdin.read()
del _sys
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_announced: set[str] = set()


class SandboxUnavailable(ValueError):
    """`sandbox = "bwrap"` was asked for where bwrap cannot run (a ValueError: environments turn it into a
    one-line user error)."""


def resolve_mode(mode: str) -> str:
    """`bwrap` or `process` for a setting of `sandbox`; raises SandboxUnavailable for `bwrap` without it."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOX_MODES)}, not {mode!r}")
    if mode == "process":
        return mode
    problem = bwrap.probe()
    if problem is None:
        return "bwrap"
    if mode == "bwrap":
        raise SandboxUnavailable(
            f'sandbox = "bwrap" but {problem} (install bubblewrap, or set sandbox = "auto" to allow '
            "the in-process limits)"
        )
    return "process"


def announce(mode: str) -> None:
    """One log line per process and mode: which sandbox model-written code runs in."""
    if mode in _announced:
        return
    _announced.add(mode)
    if mode == "bwrap":
        logger.info(
            "code sandbox: bubblewrap (no network, read-only system directories only, private /tmp, limits)"
        )
    else:
        reason = bwrap.probe() or 'sandbox = "process"'
        logger.warning(
            "code sandbox: in-process limits only (%s): the code can read every file this user can; "
            'install bubblewrap (or set sandbox = "bwrap" to require it)',
            reason,
        )


@dataclass(frozen=True)
class Execution:
    """How one run ended: what it printed (capped), its exit status (negative: killed by that signal)."""

    output: str
    returncode: int | None
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return self.timed_out or self.returncode != 0


class PythonSandbox:
    """Runs Python code in a fresh interpreter under bwrap, or under the in-process limits (`mode`).

    `run(code)` → stdout + stderr (truncated) of the code, prefixed `error:` when it failed (an exception,
    a signal, the timeout); `execute(code)` → the `Execution`; `execute_sync` for reward workers.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        memory_mb: int = 512,
        max_output: int = 4000,
        mode: str = "auto",
        max_processes: int = 64,
    ):
        self.timeout = timeout
        self.max_output = max_output
        self.mode = resolve_mode(mode)
        announce(self.mode)  # here too: the process that builds the environment says what its rollouts use
        self.limits = bwrap.Limits(
            cpu_seconds=int(timeout) + 1,  # a backstop: the wall-clock timeout normally fires first
            memory_mb=memory_mb,
            max_processes=max_processes,
        )

    async def run(self, code: str) -> str:
        result = await self.execute(code)
        text = truncate(result.output, self.max_output) if result.output.strip() else "(no output)"
        if result.timed_out:
            return f"error: timed out after {self.timeout:g} s\n{text}"
        if result.returncode is not None and result.returncode < 0:
            return f"error: killed by signal {-result.returncode}\n{text}"
        if result.returncode:
            return f"error: exit status {result.returncode}\n{text}"
        return text

    def execute_sync(self, code: str) -> Execution:
        """`execute` from synchronous code (a reward worker); in a thread when this one runs an event loop."""
        return run_blocking(self.execute(code))

    async def execute(self, code: str) -> Execution:
        announce(self.mode)
        if self.mode == "bwrap":
            return await self._execute_bwrap(code)
        with tempfile.TemporaryDirectory(prefix="tidal-sandbox-") as workdir:
            prelude = process_prelude(self.limits, uid=None)
            return await self._communicate(
                [sys.executable, "-I", "-S", "-c", prelude + _NO_NETWORK_PRELUDE + _RUN_STDIN],
                code,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"},
            )

    async def _execute_bwrap(self, code: str) -> Execution:
        python = os.path.realpath(sys.executable)
        argv = [
            *bwrap.bwrap_argv(str(bwrap.find_bwrap()), python, os.geteuid() == 0),
            *bwrap.tmp_argv(self.limits),
            python, "-I", "-S", "-c", bwrap.sandbox_prelude(self.limits, bwrap.run_as_uid()) + _RUN_STDIN,
        ]  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        return await self._communicate(argv, code, cwd="/", env=env)

    async def _communicate(self, argv: list[str], code: str, cwd: str, env: dict[str, str]) -> Execution:
        return await communicate(argv, code.encode(), cwd, env, self.timeout, self.max_output)


def process_prelude(limits: bwrap.Limits, uid: int | None) -> str:
    """Python run first by the fallback's child (a fresh `python -I -S -c`): its rlimits (the process limit
    where the kernel lets this user set it), a network namespace where the kernel allows one (root: a network
    one; a user: a user namespace first, since an unprivileged user may not make a network one alone), then,
    given `uid` (tidal runs as root), that user for good.

    This is not a `preexec_fn`: with one, subprocess forks the whole parent (the orchestrator, with torch
    loaded) and waits, on the event loop's thread, while the child runs Python up to its exec, and every
    request in flight waits with it (README, "Sandbox"; benchmarks/sandbox_loop_hold.py). Without one, the
    child is vforked and exec'd at once, and this runs in it."""
    flags = CLONE_NEWNET if uid is not None else CLONE_NEWUSER | CLONE_NEWNET
    lines = [
        "import os as _os, resource as _r, ctypes as _c",
        *bwrap.limit_lines(limits, nproc_optional=True),
        "try:",  # where the kernel refuses namespaces, the limits alone (as `announce` says)
        f"    _c.CDLL(None, use_errno=True).unshare({flags})",
        "except (OSError, AttributeError):",
        "    pass",
        *bwrap.user_lines(uid),
        "del _os, _r, _c",
    ]
    return "\n".join(lines) + "\n"


def run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end from synchronous code (a reward worker); in a thread of its own when this one
    already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, work).result()


async def communicate(
    argv: list[str],
    stdin: bytes | None,
    cwd: str,
    env: dict[str, str],
    timeout: float,
    max_output: int,
) -> Execution:
    """Start `argv` in a process group of its own, feed it `stdin` (None: nothing), keep the first `max_output`
    bytes it prints (the rest is read and dropped), kill the group at the timeout or once it has exited."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    kept = bytearray()
    timed_out = False
    try:
        await asyncio.wait_for(_exchange(process, stdin, kept, max_output), timeout)
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(process.pid)  # whatever it started in its group goes too
        await process.wait()  # reap it, so its pipes close on this event loop
        if process.stdout is not None:  # and let its stdout close here too (its writers are gone now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.stdout.read(), 1.0)
    return Execution(kept.decode(errors="replace"), process.returncode, timed_out)


async def _exchange(
    process: asyncio.subprocess.Process, stdin: bytes | None, kept: bytearray, max_output: int
) -> None:
    assert process.stdout is not None
    if stdin is not None:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may exit before reading
            process.stdin.write(stdin)
            await process.stdin.drain()
            process.stdin.close()
    limit = max_output + 1024  # a little more than is shown, so that truncation says how much
    while chunk := await process.stdout.read(65536):
        kept += chunk[: max(0, limit - len(kept))]
    await process.wait()


CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def python_tool(sandbox: PythonSandbox | None = None) -> Tool:
    """The `python` tool: runs the model's code in `sandbox`; a failed run's result starts with `error:`."""
    box = sandbox or PythonSandbox()

    async def python(code: str) -> str:
        return await box.run(code)

    return Tool(
        name="python",
        description="Run Python 3 code (no network); returns what it prints.",
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python source; use print() for output."}
            },
            "required": ["code"],
        },
        fn=python,
    )

"""Tools for `tool_use`: an arithmetic calculator (AST-checked, bounded) and a sandboxed Python executor.

The executor runs the code in a fresh `python -I` subprocess, in its own temporary directory and process
group, with rlimits on CPU time, address space, file size and process count, and a wall-clock timeout that
kills the group. Network: the child first tries to enter new user+network namespaces (no interfaces but a
down loopback); where unprivileged namespaces are not allowed, a prelude replaces the socket constructors so
the code cannot open connections. That fallback stops accidents and naive code, not a determined attacker
(ctypes can still make syscalls): run untrusted models in a container too.
"""

import ast
import asyncio
import contextlib
import ctypes
import operator
import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

from tidal.envs.tools import Tool, truncate

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
        "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
        "required": ["expression"],
    },
    fn=calculate,
)

# Runs before the user's code in the child: if the network namespace could not be entered, no socket can
# be created from Python.
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


class PythonSandbox:
    """`run(code)` → stdout + stderr (truncated) of the code, or why it was stopped."""

    def __init__(self, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4000):
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.max_output = max_output

    async def run(self, code: str) -> str:
        with tempfile.TemporaryDirectory(prefix="tidal-sandbox-") as workdir:
            script = Path(workdir) / "main.py"
            script.write_text(_NO_NETWORK_PRELUDE + "\n" + code)
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(script),
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._limit,
            )  # fmt: skip
            try:
                output, _ = await asyncio.wait_for(process.communicate(), self.timeout)
            except TimeoutError:
                return f"error: timed out after {self.timeout:g} s"
            finally:
                _kill_group(process.pid)  # whatever the code started in its group goes too
                await process.wait()  # reap it, so its pipes close on this event loop
        text = output.decode(errors="replace")
        if process.returncode and process.returncode < 0:
            text += f"\n[killed by signal {-process.returncode}]"
        return truncate(text, self.max_output) if text.strip() else "(no output)"

    def _limit(self) -> None:
        """In the child, before exec: resource limits, then a network namespace if the kernel allows it."""
        cpu = int(self.timeout) + 1  # a backstop: the wall-clock timeout normally fires first
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024, 16 * 1024 * 1024))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
        _unshare_network()


def _unshare_network() -> None:
    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).unshare(clone_newuser | clone_newnet)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def python_tool(sandbox: PythonSandbox | None = None) -> Tool:
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

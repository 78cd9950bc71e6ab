"""The OS sandbox (bubblewrap) for model-written code: what it blocks, through tool_use rollouts and directly.

These tests need bwrap (the `needs_bwrap` fixture): outside CI they are skipped where it is missing (with how
to install it); in CI (`CI=true`) a missing or broken bwrap fails them: `.ci/run` installs it.
"""

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests.unit.test_envs_multiturn import roll
from tidal.envs import bwrap
from tidal.envs.sandbox import PythonSandbox, SandboxUnavailable, resolve_mode
from tidal.envs.tool_use import ToolUseEnv
from tidal.errors import UserError


def python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


BOMB_NAME = "tidal-forkbomb"
FORK_BOMB = f"""
import ctypes, os
ctypes.CDLL(None).prctl(15, b"{BOMB_NAME}", 0, 0, 0)  # PR_SET_NAME: its processes can be found from outside
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def processes_named(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                found.append(int(entry.name))
        except OSError:
            continue  # it exited while we looked
    return found


def test_the_command_line_isolates_and_binds_only_system_dirs_and_python():
    argv = bwrap.bwrap_argv("/usr/bin/bwrap", "/opt/py/bin/python3", is_root=False)
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-user", "--die-with-parent", "--new-session"):
        assert flag in argv
    python_install = set(bwrap.python_dirs("/opt/py/bin/python3"))
    bound = {argv[i + 2] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind")} - python_install
    assert bound <= {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache"}
    assert "--bind" not in argv  # nothing of the host is writable
    assert "--unshare-user" not in bwrap.bwrap_argv("/usr/bin/bwrap", "/opt/py/bin/python3", is_root=True)
    tmp = bwrap.tmp_argv(bwrap.Limits(cpu_seconds=3, memory_mb=256, tmp_mb=8))
    assert tmp[tmp.index("--size") + 1] == str(8 << 20) and tmp[-2:] == ["--remount-ro", "/"]


def test_the_prelude_sets_the_limits_and_leaves_root_for_its_own_uid():
    prelude = bwrap.sandbox_prelude(
        bwrap.Limits(cpu_seconds=3, memory_mb=256, max_processes=8), uid=1_600_000_000
    )
    assert "RLIMIT_NPROC, (8, 8)" in prelude and "RLIMIT_AS, (268435456, 268435456)" in prelude
    assert prelude.index("setrlimit") < prelude.index("_os.setuid(1600000000)")
    assert "setuid" not in bwrap.sandbox_prelude(bwrap.Limits(3, 256), uid=None)
    compile(prelude, "prelude", "exec")


def test_bad_sandbox_settings_are_one_line_errors(monkeypatch):
    from tidal.envs.registry import load_env

    with pytest.raises(UserError, match="sandbox must be one of auto, bwrap, process"):
        load_env("tool_use", sandbox="docker")
    monkeypatch.setattr(bwrap, "probe", lambda: "bwrap (bubblewrap) is not installed")
    with pytest.raises(SandboxUnavailable, match='sandbox = "bwrap" but bwrap .* is not installed'):
        resolve_mode("bwrap")
    with pytest.raises(UserError, match="environment 'code': sandbox = \"bwrap\" but"):
        load_env("code", sandbox="bwrap")
    assert resolve_mode("auto") == "process"  # the fallback, warned when it first runs


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text("the-secret-value")
    return path


ATTACKS = {
    "read_outside_file": "print(open({secret!r}).read())",
    "read_etc_shadow": "print(open('/etc/shadow').read())",
    "write_outside": "open('/usr/tidal-was-here', 'w').write('x')",
    "network": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)",
    "fork_bomb": FORK_BOMB,
    "allocate_10_gb": "x = bytearray(10 * 1024**3); print(len(x))",
    "run_forever": "while True:\n    pass",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_code_is_a_failed_tool_call_and_the_rollout_goes_on(needs_bwrap, tmp_path, attack):
    secret = secret_file(tmp_path)
    env = ToolUseEnv(num_examples=5, python_timeout=2.0, sandbox="bwrap")
    task = env.task(0)
    replies = [python_call(ATTACKS[attack].format(secret=str(secret))), f"<answer>{task.answer}</answer>"]
    start = time.monotonic()
    episode, _ = roll(env, task, replies)
    result = str(episode.messages[3]["content"])
    assert result.startswith("error:"), result
    assert "the-secret-value" not in result and "root:" not in result
    assert episode.metrics["tools/num_tool_errors"] == episode.metrics["tools/num_tool_calls"] == 1
    assert episode.reward == 1.0 and episode.num_turns == 2  # the episode went on to its answer
    assert time.monotonic() - start < 30  # bounded by the timeout, not by the attack (a backstop only)
    assert not Path("/usr/tidal-was-here").exists()
    if attack == "fork_bomb":
        assert "timed out" in result
        deadline = time.monotonic() + 5
        while processes_named(BOMB_NAME) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_named(BOMB_NAME) == []
    if attack == "allocate_10_gb":
        assert "MemoryError" in result


def test_what_the_sandbox_lets_code_do(needs_bwrap):
    box = PythonSandbox(timeout=5, memory_mb=256, mode="bwrap")

    async def run_all():
        return await asyncio.gather(
            box.run("print(sum(range(10)))"),
            box.run("import os; print(os.getcwd(), sorted(os.listdir('/')))"),
            box.run("open('/tmp/a', 'w').write('hi'); print(open('/tmp/a').read())"),
            box.run(
                "import subprocess; print(subprocess.run(['echo', 'child'], capture_output=True).stdout)"
            ),
            box.run("import os; print(os.getuid() != 0)"),
        )

    ok, listing, tmp, child, not_root = asyncio.run(run_all())
    assert ok.strip() == "45"
    cwd, _, names = listing.partition(" ")
    assert cwd == "/tmp" and "home" not in names and "work" not in names and "sys" not in names
    assert tmp.strip() == "hi" and "child" in child and not_root.strip() == "True"


def test_a_sandbox_that_fills_tmp_is_stopped_at_its_size(needs_bwrap):
    box = PythonSandbox(timeout=5, memory_mb=256, mode="bwrap")
    code = "for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20))"
    result = asyncio.run(box.run(code))
    assert result.startswith("error:") and ("No space left" in result or "File too large" in result)


def test_the_sync_entry_point_works_inside_an_event_loop(needs_bwrap):
    box = PythonSandbox(timeout=5, memory_mb=256, mode="bwrap")

    async def from_a_loop():
        return box.execute_sync("print('x')")

    assert box.execute_sync("print(1)").output.strip() == "1"
    assert asyncio.run(from_a_loop()).output.strip() == "x"

"""bubblewrap (`bwrap`): the OS sandbox that model-written code runs in, when the machine has it.

`bwrap_argv` builds the command line (pure): new pid, network, ipc, uts (and cgroup) namespaces, no
network interface but loopback, a root of its own that is read-only and holds only the system directories
(/usr and its /bin, /lib links) and the Python installation, read-only; a private, size-capped /tmp as
the working directory; fresh /proc and a minimal /dev. The home directories, /etc (but the loader's
cache), the run's outputs and every other file of the machine are not there at all. The sandbox dies with
its parent (`--die-with-parent`), and with its pid namespace every process the code started goes.

Run by a normal user, bwrap puts the code in a new user namespace: it has no capabilities, and the process
limit the code sets inside counts only that sandbox's processes. Run by root, bwrap needs no user namespace
and the code would be root; `sandbox_prelude` then switches to a user id of its own, drawn for that run
from a range no account uses (`run_as_uid`), before any model code runs: root is exempt from the process
limit, root-only files stay unreadable, and a fork bomb in one sandbox cannot use up the processes of
another (they would share them as one `nobody`).

`probe()` checks once per process that bwrap starts a sandbox here (it may be installed while user
namespaces are disabled): the answer decides what `auto` uses.
"""

import functools
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UIDS = (1_500_000_000, 2_000_000_000)
"""Where root draws each sandbox's user id: above any account's, below the 32-bit ids' special values."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Mounted read-only where they exist (as the symlinks they are on merged-/usr systems)."""
LOADER_FILES = ("/etc/ld.so.cache",)
"""Outside the system directories, what programs need to start quickly: the dynamic loader's cache."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits, applied inside the child (both sandboxes) and, for the disk, to bwrap's /tmp."""

    cpu_seconds: int
    memory_mb: int
    max_processes: int = 64
    max_file_mb: int = 16
    tmp_mb: int = 64


def bwrap_argv(bwrap: str, python: str, is_root: bool) -> list[str]:
    """The bwrap command line before the sandboxed command (`python` must be the real interpreter path)."""
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not is_root:
        argv.append("--unshare-user")  # root keeps the host's users so that the prelude can become nobody
    argv += ["--die-with-parent", "--new-session"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in LOADER_FILES:
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for path in python_dirs(python):
        argv += ["--ro-bind", path, path]
    # bwrap creates the parents of mount points with the host's modes (/root is 0700): open them up, or
    # nobody could not reach the interpreter
    for parent in sorted({str(p) for d in (*python_dirs(python), *LOADER_FILES) for p in Path(d).parents}):
        if parent != "/":
            argv += ["--chmod", "0755", parent]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    return argv


def private_tmp_argv(limits: Limits) -> list[str]:
    """The private /tmp: world-writable, sticky, size-capped (a tmpfs is memory)."""
    return ["--perms", "1777", "--size", str(limits.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]


def tmp_argv(limits: Limits) -> list[str]:
    """The private /tmp as the working directory, and the read-only root."""
    return [*private_tmp_argv(limits), "--chdir", "/tmp", "--remount-ro", "/"]


def python_dirs(python: str) -> list[str]:
    """The directories the interpreter needs outside the system directories: its installation prefix."""
    prefix = os.path.realpath(sys.base_prefix)
    found = [] if _under_system_dir(prefix) else [prefix]
    binary_dir = os.path.dirname(os.path.realpath(python))
    if not _under_system_dir(binary_dir) and not binary_dir.startswith(prefix + os.sep):
        found.append(binary_dir)
    return found


def _under_system_dir(path: str) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in SYSTEM_DIRS)


def run_as_uid() -> int | None:
    """The user id the code runs as when tidal runs as root (a fresh one per sandbox); None otherwise."""
    if os.geteuid() != 0:
        return None
    return random.randrange(*SANDBOX_UIDS)


def sandbox_prelude(limits: Limits, uid: int | None) -> str:
    """Python run first inside bwrap: the limits (set in the sandbox's user namespace, where the process
    limit counts its own processes only), then, when started as root, the switch to user `uid`."""
    return (
        "\n".join(["import os as _os, resource as _r", *limit_lines(limits), *user_lines(uid), "del _os, _r"])
        + "\n"
    )


def limit_lines(limits: Limits, nproc_optional: bool = False) -> list[str]:
    """Python lines (with `resource` as `_r`) setting the sandbox's rlimits on the running process. The
    process limit is `nproc_optional` where the kernel may refuse it to this user (outside bwrap)."""
    limit = [
        ("CPU", limits.cpu_seconds, limits.cpu_seconds + 1),
        ("AS", limits.memory_mb << 20, limits.memory_mb << 20),
        ("FSIZE", limits.max_file_mb << 20, limits.max_file_mb << 20),
        ("CORE", 0, 0),
    ]
    lines = [f"_r.setrlimit(_r.RLIMIT_{name}, ({soft}, {hard}))" for name, soft, hard in limit]
    nproc = f"_r.setrlimit(_r.RLIMIT_NPROC, ({limits.max_processes}, {limits.max_processes}))"
    if nproc_optional:
        return [*lines, "try:", f"    {nproc}", "except (ValueError, OSError):", "    pass"]
    return [*lines, nproc]


def user_lines(uid: int | None) -> list[str]:
    """Python lines (with `os` as `_os`) switching a root process to user `uid` for good (none for None)."""
    return [] if uid is None else ["_os.setgroups([])", f"_os.setgid({uid})", f"_os.setuid({uid})"]


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def probe() -> str | None:
    """Why bwrap cannot sandbox code here (missing, or it fails to start), or None when it works."""
    bwrap = find_bwrap()
    if bwrap is None:
        return "bwrap (bubblewrap) is not installed"
    python = os.path.realpath(sys.executable)
    argv = [
        *bwrap_argv(bwrap, python, os.geteuid() == 0),
        *tmp_argv(Limits(5, 256)),
        python,
        "-I",
        "-S",
        "-c",
        "",
    ]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap failed to start: {exc}"
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bwrap failed to start a sandbox: {message[-1] if message else f'exit {done.returncode}'}"
    return None

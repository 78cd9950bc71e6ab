"""Shell commands inside a repository, sandboxed: what the `swe` environment's `bash` tool and its hidden tests
run in.

`RepoSandbox.run(repo, command)` runs `bash -c command` with the repository as the working directory and the
only writable place besides a private /tmp. Under bubblewrap (`tidal.envs.bwrap`) the repository is bound at
/repo in a root of its own: no network, read-only system directories and Python, fresh pid namespace (every
process the command started dies with it). Under the fallback (`sandbox = "process"`, or `auto` without
bwrap) the command runs in the repository on the host, in a network namespace where the kernel allows one.
Both apply rlimits (CPU, memory, file size, processes) and a wall-clock timeout that kills the process
group; as root, both first switch to a user id of their own (`bwrap.run_as_uid`), given the repository, so
the process limit holds and nothing else of the machine's is writable.

`python` and `python3` on the command's PATH are the interpreter tidal runs on (the repository's code and
tests need nothing beyond the standard library). Under the fallback as root, the command's own user must be
able to reach that interpreter; where it cannot (pyenv under a 0700 /root), the first `python3` on PATH
that it can reach stands in, and with none the sandbox is refused at construction. That user must also
reach the repository: `workspace()` makes the directories it lives in, passable by others (0711, no
listing); a repository elsewhere under a closed directory is a one-line error of the command, never a run
that fails unseen (every hidden test would fail, and every episode score 0).
"""

import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tidal.envs import bwrap
from tidal.envs.sandbox import (
    Execution,
    announce,
    communicate,
    process_prelude,
    resolve_mode,
    run_blocking,
)

REPO_MOUNT = "/repo"
"""Where the repository is inside bubblewrap."""
BIN_DIR = "/opt/tidal/bin"
"""Inside bubblewrap: `python` and `python3` links to tidal's interpreter."""
# Run first in the sandbox: the limits and, as root, the switch of user; then bash takes over the process.
_EXEC_BASH = "import os as _o, sys as _s\n_o.execv('/bin/bash', ['bash', '-c', _s.argv[1]])\n"


class RepoSandbox:
    """`bash -c` in a repository under bubblewrap or the in-process limits (`mode`, as `PythonSandbox`)."""

    def __init__(
        self,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        max_output: int = 4000,
        mode: str = "auto",
        max_processes: int = 64,
    ):
        self.timeout, self.max_output = timeout, max_output
        self.mode = resolve_mode(mode)
        self.python = os.path.realpath(sys.executable)
        if self.mode == "process" and os.geteuid() == 0:
            self.python = reachable_python(self.python)
        announce(self.mode)
        self.limits = bwrap.Limits(
            cpu_seconds=int(timeout) + 1, memory_mb=memory_mb, max_processes=max_processes, max_file_mb=16
        )

    def run_sync(self, repo: Path, command: str) -> Execution:
        """`run` from synchronous code (a reward worker)."""
        return run_blocking(self.run(repo, command))

    async def run(self, repo: Path, command: str) -> Execution:
        """What `command` printed (stdout and stderr, the first `max_output` bytes), and how it ended."""
        uid = bwrap.run_as_uid()
        if uid is not None:
            _give(repo, uid)
            if self.mode != "bwrap" and not open_to_others(str(repo)):
                raise PermissionError(
                    f"the command sandbox's user cannot reach {repo}: a directory above it is closed to others "
                    "(make repositories with repo_sandbox.workspace(), or point TMPDIR at an open directory)"
                )
        python = self.python
        if self.mode == "bwrap":
            argv = [
                *bwrap.bwrap_argv(str(bwrap.find_bwrap()), python, os.geteuid() == 0),
                *bwrap.private_tmp_argv(self.limits),
                "--dir", BIN_DIR, "--symlink", python, f"{BIN_DIR}/python", "--symlink", python, f"{BIN_DIR}/python3",
                "--bind", str(repo), REPO_MOUNT, "--chdir", REPO_MOUNT, "--remount-ro", "/",
                python, "-I", "-S", "-c", bwrap.sandbox_prelude(self.limits, uid) + _EXEC_BASH, command,
            ]  # fmt: skip
            env = _env(BIN_DIR, home="/tmp", shown_cwd=REPO_MOUNT)
            return await communicate(argv, None, "/", env, self.timeout, self.max_output)
        with tempfile.TemporaryDirectory(prefix="tidal-repo-bin-") as bin_dir:
            for name in ("python", "python3"):
                os.symlink(python, os.path.join(bin_dir, name))
            os.chmod(bin_dir, 0o755)
            env = _env(bin_dir, home=str(repo), shown_cwd=str(repo))
            # the limits, the network namespace and the user are set by a prelude in the child, not by a
            # preexec_fn on this process's event loop (`process_prelude`); then bash takes the process over
            argv = [python, "-I", "-S", "-c", process_prelude(self.limits, uid) + _EXEC_BASH, command]
            return await communicate(argv, None, str(repo), env, self.timeout, self.max_output)


@contextlib.contextmanager
def workspace(prefix: str) -> Iterator[Path]:
    """A fresh `<tmp>/<prefix>…/repo` path (not created yet) that the sandbox's own user can reach: the
    directory above it lets others pass (0711) but not list it. Removed afterwards, with what is in it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        os.chmod(root, 0o711)  # mkdtemp makes it 0700: as root, the sandboxed user could not enter the repo
        yield Path(root) / "repo"


def reachable_python(own: str) -> str:
    """`own` if a user of no group can run it, else the first `python3` on PATH that one can (the
    repositories need only the standard library); ValueError with neither."""
    if open_to_others(own):
        return own
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("python3", path=folder) if folder else None
        if found and open_to_others(os.path.realpath(found)):
            return os.path.realpath(found)
    raise ValueError(
        f"the command sandbox runs as a user of its own, who cannot reach the interpreter {own} (a directory "
        "on its path is closed to others), and no python3 on PATH is open to it: install bubblewrap, or a "
        "python3 that others can run"
    )


def open_to_others(path: str) -> bool:
    """Whether a user of no group can run `path`: it and every directory above it allow others to enter."""
    target = Path(path)
    for part in [target, *target.parents]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


def _env(bin_dir: str, home: str, shown_cwd: str) -> dict[str, str]:
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": home,
        "PWD": shown_cwd,
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }


def _give(repo: Path, uid: int) -> None:
    """The repository to `uid` (root only): the sandboxed user may write it, and nothing else of the host."""
    for path in [repo, *repo.rglob("*")]:
        if not path.is_symlink():
            os.chown(path, uid, uid)

"""User-facing errors: the CLI prints them as one line and exits non-zero, without a traceback."""

import errno
import shutil
from pathlib import Path

USER_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR}
)
"""OSErrors that mean the user's filesystem (full, read-only, no permission, a file where a directory must
be), not a bug: shown as one line naming the path instead of a traceback."""

FULL_BELOW_BYTES = 1 << 20
"""A write that failed on a filesystem with less than this free is taken for a full disk (the failed write
itself left a partial file that took what was left)."""


class UserError(Exception):
    """A problem with the user's input (config, data, environment) that they can fix.

    `exit_code` 2 is used for configuration errors found before anything starts, 1 for the rest.
    """

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


NO_RESTART_EXIT = 3
"""Exit code of a process of `tidal rl` that stopped for a reason a restart would meet again (`RunStop`)."""


class RunStop(UserError):
    """A stop during a run that restarting the process cannot change: it resumes from the same state into the
    same situation (no rollout of a step differs from its group's others, every rollout too long to train on).
    Exit code 3, which `tidal rl` takes as "stop the run now" instead of spending its restarts on it."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=NO_RESTART_EXIT)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_error(path: Path, exc: BaseException) -> UserError | None:
    """A one-line UserError naming `path` when writing there failed because of the filesystem; None when
    `exc` looks like anything else. Writers that wrap the OS error in their own (torch.save's "unexpected
    pos", a checkpoint exception from every rank, safetensors' IoError) are recognised by the free space."""
    if isinstance(exc, OSError) and exc.errno in USER_ERRNOS:
        return UserError(f"{exc.filename or path}: {exc.strerror}")
    free = free_bytes(path)
    if free is not None and free < FULL_BELOW_BYTES:
        return UserError(f"{path}: cannot write: no space left on device ({free} bytes free)")
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent); None if unknown."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None

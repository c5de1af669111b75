"""The two kinds of failure a user sees, and the exit codes they map to.

Every error names what is wrong (file, line, field) and what to do about it. The CLI prints
``message`` and ``remedy`` without a traceback and exits with ``exit_code``:
0 = success, 1 = a check or stage failed, 2 = usage / config / input error.
"""

from __future__ import annotations

import errno


class EaglekitError(Exception):
    """A failure of a check or a stage (exit code 1)."""

    exit_code = 1

    def __init__(self, message: str, remedy: str | None = None):
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        return self.message if not self.remedy else f"{self.message}\n  remedy: {self.remedy}"


class UsageError(EaglekitError):
    """Bad config, bad flags, or bad input data (exit code 2)."""

    exit_code = 2


# Faults of the machine rather than of eaglekit or the input: the stage stops with a message that names the
# file and says what to do, never a traceback.
DISK_ERRNOS = {
    errno.ENOSPC: ("disk full", "free space on that filesystem (or point run_dir at a larger one)"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota (or point run_dir elsewhere)"),
    errno.EACCES: ("permission denied", "make the folder writable for this user (chmod / chown)"),
    errno.EPERM: ("permission denied", "make the folder writable for this user (chmod / chown)"),
    errno.EROFS: ("read-only file system", "remount it read-write or point run_dir at a writable filesystem"),
    errno.EIO: ("I/O error", "check the disk or network volume (dmesg, the storage's health)"),
}


def io_failure(err: BaseException | None) -> OSError | None:
    """The disk fault (an OSError with one of DISK_ERRNOS) behind ``err``, following its causes; else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
            return err
        err = err.__cause__ or err.__context__
    return None

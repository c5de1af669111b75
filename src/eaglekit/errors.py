"""The two kinds of failure a user sees, and the exit codes they map to.

Every error names what is wrong (file, line, field) and what to do about it. The CLI prints
``message`` and ``remedy`` without a traceback and exits with ``exit_code``:
0 = success, 1 = a check or stage failed, 2 = usage / config / input error.
"""

from __future__ import annotations


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

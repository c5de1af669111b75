"""Progress for long work: done/total, rate and ETA, plus live figures (loss, tok/s, errors).

On a terminal it is a rich progress bar; under nohup/CI/a log file it prints one line every
``log_every`` seconds instead, so a multi-hour run always says where it stands. All of it goes to
stderr: stdout is reserved for ``--json`` documents.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True, highlight=False, soft_wrap=True)


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def human_bytes(n: float) -> str:
    """Decimal units (1 GB = 10^9 bytes), as disks and volumes are sold and `df -H` prints them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


class Meter:
    """Counts units of work and shows rate and ETA. Use as a context manager."""

    def __init__(
        self, description: str, total: int | None, unit: str = "it", log_every: float = 30.0, initial: int = 0
    ):
        self.description, self.total, self.unit, self.log_every = description, total, unit, log_every
        self.done = initial
        self._start_done = initial
        self.fields: dict[str, Any] = {}
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Meter:
        if console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("[cyan]{task.fields[rate]}"),
                TextColumn("{task.fields[extra]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.description, total=self.total, completed=self.done, rate="", extra=""
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        console.print(self.line())

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._t0
        return (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        if self.total is None or self.rate <= 0:
            return None
        return (self.total - self.done) / self.rate

    def _extra(self) -> str:
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.fields.items())

    def line(self) -> str:
        total = f"/{self.total}" if self.total is not None else ""
        eta = self.eta_seconds
        eta_s = f" ETA {format_duration(eta)}" if eta is not None and self.done < (self.total or 0) else ""
        return (
            f"{self.description}: {self.done}{total} {self.unit} {self.rate:.2f} {self.unit}/s "
            f"elapsed {format_duration(time.monotonic() - self._t0)}{eta_s} {self._extra()}"
        ).rstrip()

    def update(self, n: int = 1, **fields: Any) -> None:
        self.done += n
        self.fields.update(fields)
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, completed=self.done, rate=f"{self.rate:.2f} {self.unit}/s", extra=self._extra()
            )
        elif time.monotonic() - self._last_log >= self.log_every:
            self._last_log = time.monotonic()
            console.print(self.line())

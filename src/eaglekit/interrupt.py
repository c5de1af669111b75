"""Ctrl-C and SIGTERM: stop cleanly, lose nothing that is finished, exit 130 (SIGINT) or 143 (SIGTERM).

By default both signals raise at once (SIGTERM as ``Terminated``, a KeyboardInterrupt, so one clean-up path
serves both): the stage records itself *incomplete* and every append-only or atomic output stays as it was.
Work that would lose minutes to an immediate stop (a training step and its checkpoint) wraps itself in
``StopRequest``: the first signal only asks it to stop at the next safe point; a second one stops at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, `kill`), handled like Ctrl-C."""


def exit_code(err: BaseException) -> int:
    """The shell's convention: 128 + the signal number."""
    return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def raise_on_sigterm() -> None:
    """Make SIGTERM raise ``Terminated`` in the main thread (the CLI calls this once)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


class StopRequest:
    """While active, SIGINT / SIGTERM set ``signum`` instead of raising; the work polls ``requested`` at its safe
    points and calls ``stop()`` once it has saved. A second signal raises at once."""

    def __init__(self, on_request=None):
        self.signum: int | None = None
        self.on_request = on_request  # called once with the signal's name, e.g. to say what happens next
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.stop(signum)
        self.signum = signum
        if self.on_request is not None:
            self.on_request(signal.Signals(signum).name)

    def stop(self, signum: int | None = None) -> None:
        """Raise what the (first) signal asked for: KeyboardInterrupt for SIGINT, Terminated for SIGTERM."""
        signum = signum or self.signum or signal.SIGINT
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

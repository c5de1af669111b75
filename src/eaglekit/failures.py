"""How a stage that stopped without finishing is reported: in a few lines that say what happened, what is safely on
disk and what to do — and the ledger `end` event that `eaglekit status` reads.

A Ctrl-C or SIGTERM leaves the stage *incomplete* (a rerun resumes); a disk fault (full, I/O error, permission)
names the file, what is kept and the free space against the plan; a distributed fault (a peer rank that died, a
collective that timed out, a node that never joined) names this rank and says it is the machines', not eaglekit's;
the stage's own EaglekitError passes through; anything else is an unexpected error: a short message, and the full
traceback in RUN_DIR/logs.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglekit import atomic
from eaglekit.contract import StageContext
from eaglekit.errors import DISK_ERRNOS, EaglekitError, io_failure
from eaglekit.interrupt import Terminated
from eaglekit.progress import human_bytes
from eaglekit.rundir import RunDir, now_iso, tool_versions

# The attribute of an interrupt (KeyboardInterrupt, SystemExit) that carries the line the CLI prints for it;
# built-in exceptions have no field of their own for it.
NOTE_ATTRIBUTE = "eaglekit_note"


class InfrastructureFault(EaglekitError):
    """A fault of the machines or the network between them that stopped a distributed stage; ``original`` keeps
    torch's exception for ``--debug``."""

    def __init__(self, message: str, remedy: str, original: BaseException):
        super().__init__(message, remedy)
        self.original = original


REMEDIES = {
    "peer": "find why the other rank stopped (its own output, `dmesg` for the OOM killer, the scheduler's report on "
    "its node)",
    "timeout": "find where the other ranks stopped (their output; `py-spy dump --pid PID` on a hung one)",
    "init": "start every node's torchrun with the same --nnodes and rendezvous address, reachable from every node",
}


def infrastructure_fault(ctx: StageContext, err: BaseException) -> InfrastructureFault | None:
    """The message for a distributed fault behind ``err`` (this rank, what happened, what a rerun resumes from),
    or None when ``err`` is not one."""
    from eaglekit.training import distributed  # lazy: heavy (torch: `eaglekit status` and `--help` import this module)

    found = distributed.fault(err)
    if found is None:
        return None
    return InfrastructureFault(
        f"{ctx.stage}: {distributed.identity()}: {found.what} ({found.detail}); this is an infrastructure fault, "
        f"not an eaglekit bug; {kept_outputs(ctx)}",
        f"{REMEDIES[found.kind]}, then rerun the same command on every node: it resumes from what is kept",
        original=err,
    )


class StageCrashed(EaglekitError):
    """An exception no check foresaw, reported in a few lines; ``original`` keeps it for ``--debug``."""

    def __init__(self, message: str, remedy: str, original: BaseException, log: Path | None):
        super().__init__(message, remedy)
        self.original, self.log = original, log


def kept_outputs(ctx: StageContext) -> str:
    """What of the stopped stage is safely on disk, in words (the stage's own ``kept(ctx)``)."""
    try:
        what = ctx.stage_def.kept(ctx)
    except Exception:  # describing what is kept must never hide the error being reported
        what = None
    what = what or f"nothing partial of {ctx.stage} is kept (it writes its outputs whole, at the end)"
    return f"{what}; every finished stage is untouched"


def disk_situation(ctx: StageContext, path: str | None) -> str:
    """Free space where the write failed, against what the stage's own estimate says it needs."""
    try:
        free = atomic.free_bytes(path or ctx.dir)
    except OSError:
        return ""
    try:
        need = ctx.estimate().bytes
    except Exception:
        need = None
    plan = f"; the plan needs about {human_bytes(need)} for {ctx.stage}" if need else ""
    return f"{human_bytes(free)} free there{plan}"


def disk_fault(
    disk: OSError, prefix: str, kept: str, situation: Callable[[], str], where: Path | None = None
) -> EaglekitError:
    """The named error of a disk fault (full, quota, I/O, permission): the file, why, what is kept (where a rerun
    resumes from) and, for a full disk or quota, ``situation()``: the free bytes there against what is needed."""
    assert disk.errno is not None
    what, fix = DISK_ERRNOS[disk.errno]
    space = situation() if disk.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    message = f"{prefix}{what} writing {disk.filename or where} ({disk.strerror}); {kept}" + (
        f"; {space}" if space else ""
    )
    return EaglekitError(message, f"{fix}, then rerun the same command to resume")


def outside_stage(err: BaseException) -> EaglekitError | None:
    """A disk fault on a write between stages (the ledger, a stage folder's marker), named like one inside a stage;
    None for anything else."""
    disk = io_failure(err)
    if disk is None or disk.errno is None:
        return None

    def situation() -> str:
        try:
            return f"{human_bytes(atomic.free_bytes(disk.filename or '.'))} free there"
        except OSError:
            return ""

    kept = "every finished stage is kept, and what the stage in progress wrote (a rerun resumes it)"
    return disk_fault(disk, "", kept, situation)


def record(ctx: StageContext, err: BaseException, seconds: float) -> BaseException:
    """Write the stage's `end` event for a stop that was not success, and return what the caller should raise:
    the interrupt itself, the stage's own EaglekitError, or an EaglekitError that explains a disk fault or an
    unexpected exception in a few lines (the traceback goes to a log file under the run directory)."""
    stage = ctx.stage
    event: dict[str, Any] = {
        "stage": stage,
        "event": "end",
        "fingerprint": ctx.fingerprint,
        "seconds": seconds,
        "warnings": ctx.warnings,
        **ctx.ledger_extra,
    }
    kept = kept_outputs(ctx)
    disk = io_failure(err)
    if isinstance(err, KeyboardInterrupt):
        event |= {
            "state": "incomplete",
            "error": f"interrupted ({'SIGTERM' if isinstance(err, Terminated) else 'SIGINT'})",
        }
        setattr(err, NOTE_ATTRIBUTE, f"{stage} interrupted: {kept}; rerun the same command to resume")
        out: BaseException = err
    elif isinstance(err, SystemExit):
        event |= {"state": "incomplete", "error": f"exit {err.code}"}
        out = err
    elif disk is not None and disk.errno is not None:  # io_failure gives only errnos of DISK_ERRNOS
        out = disk_fault(disk, f"{stage}: ", kept, lambda: disk_situation(ctx, disk.filename), ctx.dir)
        event |= {"state": "failed", "error": out.message, "reason": DISK_ERRNOS[disk.errno][0]}
    elif isinstance(err, EaglekitError):
        event |= {"state": "failed", "error": err.message}
        out = err
    elif (fault := infrastructure_fault(ctx, err)) is not None:
        event |= {"state": "failed", "error": fault.message, "reason": "infrastructure fault"}
        out = fault
    else:
        log = write_traceback(ctx.run, stage, err)
        message = f"{stage} stopped on an unexpected error: {type(err).__name__}: {first_line(err)}"
        event |= {"state": "failed", "error": message, "log": str(log) if log else None}
        out = StageCrashed(
            message,
            f"{kept}. The full traceback is in {log or 'no log file (it could not be written)'}"
            " (`eaglekit --debug ...` prints it here); rerun the same command once the cause "
            "is fixed, and report it if it is a bug in eaglekit",
            original=err,
            log=log,
        )
    try:
        ctx.run.append_event(event)
    except OSError as ledger_err:
        note = (
            f"the ledger {ctx.run.ledger_path} could not be written either ({ledger_err.strerror}), so "
            f"`eaglekit status` shows {stage} as incomplete until the rerun"
        )
        if isinstance(out, EaglekitError):
            out.message = f"{out.message}; {note}"
        else:
            setattr(out, NOTE_ATTRIBUTE, f"{getattr(out, NOTE_ATTRIBUTE, stage + ' stopped')}; {note}")
    return out


def first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def write_traceback(run: RunDir | None, stage: str | None, err: BaseException) -> Path | None:
    """The full traceback, with the command and versions, in RUN_DIR/logs (or the temp folder without one)."""
    text = "\n".join(
        [
            f"command: {' '.join(sys.argv)}",
            f"stage: {stage}",
            f"time: {now_iso()}",
            f"versions: {json.dumps(tool_versions())}",
            "",
            "".join(traceback.format_exception(type(err), err, err.__traceback__)),
        ]
    )
    name = f"{stage or 'eaglekit'}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        if run is None:
            raise OSError("no run directory")
        return run.write_log(name, text)
    except OSError:
        try:
            fallback = Path(tempfile.gettempdir()) / f"eaglekit-{name}"
            fallback.write_text(text, encoding="utf-8")
            return fallback
        except OSError:
            return None

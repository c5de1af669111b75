"""Other processes using the run directory: the aborted run that never took eaglekit's lock.

A process started by hand (a script of one's own, an older eaglekit from before the lock, a copy of a stage
run under another run directory path) can still be writing into the output folder. The lock cannot see
it; the kernel can. Every live process is looked at with ``psutil``: its open files, its working directory
and its command line. One holding a file inside the run directory open for writing is a ``fail``; one that
only sits there (a shell, ``tail -f``, a notebook) is listed as a ``warn``.

Not counted: this process, its ancestors (the shell that started it, torchrun's agent), its torchrun siblings
(the other ranks of this job) and the holder of the run lock, which the lock check reports.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
from pathlib import Path

import psutil

from eaglekit.contract import StageContext
from eaglekit.preflight import CheckResult, fail, ok, warn

WRITE_MODES = ("w", "a", "r+", "a+", "w+")


def _ours() -> set[int]:
    """This process, its ancestors and — under torchrun — the other ranks started by the same agent."""
    me = psutil.Process()
    pids = {me.pid, *(p.pid for p in me.parents())}
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(psutil.Error, AttributeError):
            pids |= {c.pid for c in me.parent().children(recursive=True)}
    return pids


def _inside(path: str | None, root: str) -> bool:
    return path is not None and (path == root or path.startswith(root + os.sep))


def _as_path(arg: str, cwd: str | None) -> str | None:
    """A command-line argument read as a path (``--out=runs/x`` included), absolute against the process's cwd."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    if not value or value.startswith("-") or ("/" not in value and not cwd):
        return None
    return os.path.normpath(os.path.join(cwd or "/", value))


def _describe(proc, info: dict) -> str:
    cmd = " ".join(info.get("cmdline") or []) or info.get("name") or "?"
    if len(cmd) > 120:
        cmd = cmd[:117] + "…"
    started = (
        _dt.datetime.fromtimestamp(info["create_time"]).astimezone().isoformat(timespec="seconds")
        if info.get("create_time")
        else "?"
    )
    return f"pid {proc.pid} `{cmd}` (started {started}, user {info.get('username') or '?'})"


def users_of(run_dir: Path, exclude: set[int]) -> tuple[list[str], list[str], int]:
    """(writers, other users, processes that could not be inspected) of ``run_dir``, each described in words."""
    root = str(run_dir.resolve())
    writers, others, hidden = [], [], 0
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cwd", "create_time", "username"]):
        if proc.pid in exclude:
            continue
        info = proc.info
        try:
            files = proc.open_files()
        except (psutil.AccessDenied, psutil.ZombieProcess):
            files, hidden = [], hidden + 1
        except psutil.NoSuchProcess:
            continue
        written = [f.path for f in files if _inside(f.path, root) and getattr(f, "mode", "r") in WRITE_MODES]
        read = [f.path for f in files if _inside(f.path, root) and f.path not in written]
        cwd_inside = _inside(info.get("cwd"), root)
        named = any(_inside(_as_path(a, info.get("cwd")), root) for a in (info.get("cmdline") or []))
        if written:
            rel = ", ".join(sorted({os.path.relpath(p, root) for p in written})[:3])
            writers.append(f"{_describe(proc, info)} writes {rel}")
        elif read or cwd_inside or named:
            how = ("reads " + os.path.relpath(read[0], root)) if read else ("works in it" if cwd_inside else "names it")
            others.append(f"{_describe(proc, info)} {how}")
    return writers, others, hidden


def other_processes(ctx: StageContext) -> CheckResult:
    """Live processes, other than this run's own, writing into (or sitting in) the run directory."""
    name = "other processes"
    run_dir = ctx.run.path
    if not run_dir.exists():
        return ok(name, f"{run_dir} does not exist yet")
    exclude = _ours()
    holder = ctx.run.lock.holder() or {}
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        exclude.add(holder["pid"])  # the lock check reports a live holder
    writers, others, hidden = users_of(run_dir, exclude)
    unseen = f"; {hidden} processes could not be inspected (run as their user or root to see them)" if hidden else ""
    if writers:
        return fail(
            name,
            f"{len(writers)} other process(es) write into {run_dir} without its lock: "
            + "; ".join(writers[:5])
            + unseen,
            "if it is left from an earlier run, stop it (kill PID) before this stage starts; "
            "two writers corrupt the same files",
        )
    if others:
        return warn(
            name,
            f"{len(others)} other process(es) use {run_dir}: " + "; ".join(others[:5]) + unseen,
            "nothing to do if they only read; stop any that belongs to an aborted run",
        )
    return ok(name, f"no other process uses {run_dir}{unseen}")

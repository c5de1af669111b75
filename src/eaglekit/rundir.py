"""The run directory: its layout, the ledger of stage runs, the one-process lock, and fingerprints.

Layout (each stage reads only what the run directory holds, so any stage can be rerun alone)::

    RUN_DIR/
      config.yaml        the resolved config this run uses (edit it, then `eaglekit run RUN_DIR/config.yaml`)
      ledger.jsonl       append-only: one `start` and one `end` event per stage run (state, fingerprint,
                         counts, tool versions, pre-flight results)
      .lock              flock'ed by the one eaglekit process working here; holds its pid/host/command
      <stage>/STAGE.json which fingerprint the files in this folder belong to
      generate/          responses.jsonl, errors.jsonl
      prepare/           tokens.safetensors, stats.json
      vocab/             vocab.safetensors (d2t, t2d), stats.json
      extract/           feature shards + index.json (offline mode only)
      train/             checkpoints/, metrics.jsonl, plots
      evaluate/          report.json, report.md, plots
      export/            eagle3/, speculators/, README.md

A stage's fingerprint hashes its own parameters, the identity of its external inputs, and its upstream
stage's fingerprint — so changing a parameter makes that stage and every stage after it *stale*.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from eaglekit import atomic
from eaglekit.errors import EaglekitError

LEDGER = "ledger.jsonl"
LOCK = ".lock"
MARKER = "STAGE.json"

STATES = ("pending", "running", "done", "failed", "incomplete", "stale")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def tool_versions() -> dict[str, str]:
    """Versions recorded with each stage run, so a result can be traced to the code that made it."""
    import importlib.metadata as md

    versions = {"python": sys.version.split()[0]}
    for pkg in ("eaglekit", "torch", "transformers", "tokenizers", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """A cheap identity for an input file or folder: size plus a hash of its first and last MiB per file.

    Cheap enough for multi-GB datasets, and unlike mtime it survives a copy of the same data.
    """
    path = Path(path)
    if not path.exists():
        return {"path": str(path), "missing": True}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    h = hashlib.sha256()
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        h.update(f"{f.relative_to(path) if f != path else f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return {"path": str(path), "bytes": total, "sha": h.hexdigest()[:16]}


# ----------------------------------------------------------------------------------------------- lock

@dataclass
class RunLock:
    """One eaglekit process per run directory.

    An exclusive ``flock`` on ``RUN_DIR/.lock``: the kernel releases it when the process dies, even on
    kill -9, so a crashed run never leaves a stale lock — and a second process (say, a forgotten run in
    another tmux pane) fails at once instead of writing into the same files.
    """

    run_dir: Path
    fd: int | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK

    def holder(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else None
        except (OSError, json.JSONDecodeError):
            return None

    def is_held_elsewhere(self) -> bool:
        """True when another process holds the lock (used by `status`, which never takes it)."""
        if self.fd is not None or not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def acquire(self, command: str | None = None) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            h = self.holder() or {}
            raise EaglekitError(
                f"run directory {self.run_dir} is in use by pid {h.get('pid', '?')} on host {h.get('host', '?')} "
                f"since {h.get('started', '?')}: {h.get('command', '?')}",
                f"wait for that process to finish, or stop it (kill {h.get('pid', 'PID')}); "
                "the lock is released by the kernel when it exits",
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now_iso(),
                "command": command or " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------- ledger

class RunDir:
    """Paths of a run directory and its ledger."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock = RunLock(self.path)

    def stage_dir(self, stage: str) -> Path:
        return self.path / stage

    @property
    def ledger_path(self) -> Path:
        return self.path / LEDGER

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    def append_event(self, event: dict[str, Any]) -> None:
        """Append one ledger line, fsynced: the ledger is what `status` trusts after a crash."""
        self.path.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"ts": now_iso(), **event}, default=str) + "\n"
        with open(self.ledger_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def events(self) -> Iterator[dict[str, Any]]:
        if not self.ledger_path.exists():
            return
        with open(self.ledger_path, encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash mid-append; the start event before it stands

    def last_events(self) -> dict[str, dict[str, Any]]:
        """Per stage, its last start and last end event (``{"start": ..., "end": ...}``)."""
        out: dict[str, dict[str, Any]] = {}
        for ev in self.events():
            slot = out.setdefault(ev.get("stage", "?"), {})
            if ev.get("event") == "start":
                slot["start"], slot["end"] = ev, None
            elif ev.get("event") == "end":
                slot["end"] = ev
        return out

    def done_fingerprint(self, stage: str) -> str | None:
        ev = self.last_events().get(stage, {})
        end = ev.get("end")
        return end.get("fingerprint") if end and end.get("state") == "done" else None

    # Stage folders say which fingerprint their files belong to, so a rerun can tell its own partial
    # data (resume) from another run's (refuse unless --force).
    def read_marker(self, stage: str) -> dict[str, Any] | None:
        p = self.stage_dir(stage) / MARKER
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def write_marker(self, stage: str, fingerprint: str) -> None:
        atomic.write_json(self.stage_dir(stage) / MARKER, {"stage": stage, "fingerprint": fingerprint, "created": now_iso()})

"""The run directory: its layout, the ledger of stage runs, the one-process lock, and fingerprints.

Layout (each stage reads only what the run directory holds, so any stage can be rerun alone)::

    RUN_DIR/
      config.yaml        the resolved config of the last run (edit it, then `eaglekit run RUN_DIR/config.yaml`)
      ledger.jsonl       append-only: one `invocation` event per command that ran stages (its config's path
                         and hash, the stages it will run), one `start` and one `end` event per stage run
                         (state, fingerprint, parameters, counts, warnings, tool versions, pre-flight results)
      .lock              flock'ed by the one eaglekit process working here; holds its pid/host/command
      logs/              full tracebacks of unexpected errors (the terminal shows a short message)
      <stage>/STAGE.json which fingerprint the files in this folder belong to
      generate/          responses.jsonl, errors.jsonl
      prepare/           tokens.safetensors, stats.json
      vocab/             vocab.safetensors (d2t, t2d), stats.json
      extract/           feature shards + index.json (offline mode only)
      train/             checkpoints/, metrics.jsonl, plots
      evaluate/          report.json, report.md, plots
      export/            eagle3/, speculators/, README.md

A stage's fingerprint hashes its own parameters, the identity of its external inputs, and its upstream
stage's fingerprint — so changing a parameter makes that stage and every stage after it *stale*. The parameters
are the values the stage computes with, resolved and under the stage's own names (``pipeline.Fingerprints``): a
config key renamed or moved, or a rule reworded, leaves a finished run done.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import functools
import hashlib
import importlib.metadata as md
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit import __version__, atomic
from eaglekit.errors import EaglekitError
from eaglekit.progress import Meter

LEDGER = "ledger.jsonl"
LOCK = ".lock"
MARKER = "STAGE.json"

# pending: not run (or its folder was removed) · queued: the command holding the lock will run it ·
# running · done · failed · incomplete: killed mid-run (rerun resumes) · stale: done with other parameters or inputs
STATES = ("pending", "queued", "running", "done", "failed", "incomplete", "stale")

# What a stage's output folder holds, relative to the fingerprint about to run there (see RunDir.folder_state).
EMPTY, OWN, FAILED_LEFTOVERS, OTHER_DONE, OTHER_PARTIAL, FOREIGN = (
    "empty",
    "own",
    "failed leftovers",
    "other done",
    "other partial",
    "foreign",
)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def tool_versions() -> dict[str, str]:
    """Versions recorded with each stage run, so a result can be traced to the code that made it."""
    versions = {"python": sys.version.split()[0], "eaglekit": __version__}
    for pkg in ("torch", "transformers", "tokenizers", "safetensors"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    return versions


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """A cheap identity for an input file or folder: size plus a hash of its first and last MiB per file.

    Cheap enough for multi-GB datasets, and unlike mtime it survives a copy of the same data. Names are not
    content: a file's own name is left out of the hash (renamed, it is the same input), a folder's files are
    hashed with their names relative to it (which file holds what is part of a folder's content). The path is
    kept for messages and the ledger; fingerprints hash ``content_identity``, without it.
    """
    path = Path(path)
    if not path.exists():
        return {"path": str(path), "missing": True}
    files = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    )
    h = hashlib.sha256()
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        h.update(f"{f.relative_to(path)}:{size}".encode() if f != path else f"{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return {"path": str(path), "bytes": total, "sha": h.hexdigest()[:16]}


def content_identity(obj: Any) -> Any:
    """``obj`` with the paths of its identities (a file's, a prompt set's: whatever holds a ``sha``) left out —
    what a fingerprint hashes, so the same data elsewhere (a run directory copied or moved, a dataset on another
    mount or under another name) is the same input."""
    if isinstance(obj, dict):
        if "sha" in obj:
            return {k: v for k, v in obj.items() if k != "path"}
        return {k: content_identity(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [content_identity(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------ content hashes
# One mechanism for every whole-file hash eaglekit keeps: a file's sha256, computed once and cached in a JSON file
# beside what it belongs to (extract's feature shards in extract/, the target's weights and the run's tokens and
# vocabulary in RUN_DIR), keyed by the file's (size, mtime_ns, inode): a rewrite gives a new inode and mtime, a
# copy a new inode, so a cached digest is the file's as long as that key holds.

DIGEST_CACHE = ".sha256-cache.json"
SHOW_HASHING_BYTES = 2_000_000_000  # hashing more than this shows a progress meter
CACHE_WRITE_SECONDS = 30.0  # a long hashing run saves what it read this often, so a stopped one keeps its work


# the one hashing function of every content hash, and the key a cached digest holds under (atomic.file_key)
sha256_file = atomic.sha256_file
file_key = atomic.file_key


@functools.lru_cache(maxsize=16)
def _read_cache(path_str: str, _key: tuple[int, ...]) -> dict[str, dict]:
    try:
        cache = json.loads(Path(path_str).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def read_digest_cache(cache_file: Path) -> dict[str, dict]:
    """{name: {"key": [size, mtime_ns, inode], "sha256": what its bytes hashed to}}, read once per change of the
    cache file (fingerprints and complete_shard ask it often)."""
    try:
        key = tuple(file_key(cache_file))
    except OSError:
        return {}
    return _read_cache(str(cache_file), key)


def cached_digest(cache: dict[str, dict], name: str, path: Path) -> str | None:
    """The sha256 ``path``'s bytes had when last hashed under ``name``, if the file is unchanged since."""
    found = cache.get(name)
    try:
        return found["sha256"] if found and found.get("key") == file_key(path) else None
    except OSError:
        return None


def hash_files(cache_file: Path, files: dict[str, Path], what: str, workers: int = 4) -> tuple[dict[str, str], int]:
    """The sha256 of each file (by name; a missing file is left out) and the bytes hashed now.

    Unchanged files take their digest from ``cache_file``; the others are read in ``workers`` threads (hashlib
    releases the GIL), shown as ``what`` when they are large, and the cache is rewritten (atomically) every
    ``CACHE_WRITE_SECONDS`` and at the end, so a stopped run keeps most of its work.
    """
    cache = dict(read_digest_cache(cache_file))
    digests: dict[str, str] = {}
    todo: list[tuple[str, Path]] = []
    for name, path in files.items():
        known = cached_digest(cache, name, path)
        if known is not None:
            digests[name] = known
        elif path.is_file():
            todo.append((name, path))
    if not todo:
        return digests, 0
    lock, hashed, written = threading.Lock(), 0, time.monotonic()

    def one(name: str, path: Path) -> None:
        nonlocal hashed, written
        key = file_key(path)
        digest = sha256_file(path)
        with lock:
            digests[name], hashed = digest, hashed + key[0]
            if file_key(path) == key:  # not rewritten while it was read
                cache[name] = {"key": key, "sha256": digest}
            if time.monotonic() - written > CACHE_WRITE_SECONDS:
                atomic.write_json(cache_file, cache)
                written = time.monotonic()

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    megabytes = [path.stat().st_size // 1_000_000 for _, path in todo]
    shown = sum(megabytes) * 1_000_000 >= SHOW_HASHING_BYTES  # minutes to hours for terabytes: shown as it goes
    with (
        Meter(f"sha256 of {what}", total=sum(megabytes), unit="MB") if shown else contextlib.nullcontext() as meter,
        ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool,
    ):
        futures = {pool.submit(one, name, path): mb for (name, path), mb in zip(todo, megabytes, strict=True)}
        try:
            for future in as_completed(futures):
                future.result()
                if meter is not None:
                    meter.update(futures[future])
        finally:  # what was read is kept, also when stopped
            with lock:
                atomic.write_json(cache_file, cache)
    return digests, hashed


def run_digests(run_path: Path, paths: list[Path], what: str) -> dict[Path, str]:
    """The sha256 of each existing file in ``paths`` (inputs of this run, inside or outside it), cached in the run
    directory: a rerun re-reads only files that changed since."""
    named = {str(p.resolve()): p for p in paths}
    digests, _ = hash_files(Path(run_path) / DIGEST_CACHE, named, what)
    return {p: digests[name] for name, p in named.items() if name in digests}


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it; on a failed write, cut the file back so no torn line stays behind."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            data = line.encode("utf-8")
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


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

    def acquire(self, command: str | None = None) -> RunLock:
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
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": now_iso(),
            "command": command or " ".join(sys.argv),
        }
        try:
            with atomic.naming_file(self.path):  # a full disk is named here too, before any stage runs
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
                os.fsync(fd)
        except OSError:
            os.close(fd)  # releases the lock
            raise
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
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
        with atomic.naming_file(self.ledger_path):
            append_line(self.ledger_path, line)

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
            if "stage" not in ev:
                continue
            slot = out.setdefault(ev["stage"], {})
            if ev.get("event") == "start":
                slot["start"], slot["end"] = ev, None
            elif ev.get("event") == "end":
                slot["end"] = ev
        return out

    def attempts(self, stage: str) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Every run of ``stage``, oldest first: (start event, end event or None while running / if killed)."""
        out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
        for ev in self.events():
            if ev.get("stage") != stage:
                continue
            if ev.get("event") == "start":
                out.append((ev, None))
            elif ev.get("event") == "end" and out and out[-1][1] is None:
                out[-1] = (out[-1][0], ev)
        return out

    def last_invocation(self) -> dict[str, Any] | None:
        """The last command that ran stages here: its config's source path and hash, the stages it planned."""
        last = None
        for ev in self.events():
            if ev.get("event") == "invocation":
                last = ev
        return last

    def done_fingerprint(self, stage: str) -> str | None:
        ev = self.last_events().get(stage, {})
        end = ev.get("end")
        return end.get("fingerprint") if end and end.get("state") == "done" else None

    def is_done(self, stage: str, fingerprint: str) -> bool:
        """Finished with ``fingerprint`` and its folder still holds those outputs (removing the folder undoes it)."""
        marker = self.read_marker(stage)
        return (
            self.done_fingerprint(stage) == fingerprint
            and marker is not None
            and marker.get("fingerprint") == fingerprint
        )

    def folder_state(self, stage: str, fingerprint: str) -> str:
        """What the stage's folder holds, for a run with ``fingerprint``:

        EMPTY             nothing (or only its marker)
        OWN               this fingerprint's outputs, finished or partial (a rerun skips or resumes)
        FAILED_LEFTOVERS  what a *failed* attempt with other parameters left: replaced without asking
        OTHER_DONE        finished outputs of other parameters: replaced only with --force
        OTHER_PARTIAL     partial outputs of other parameters (a killed run that could resume): only with --force
        FOREIGN           files no eaglekit stage run wrote (no marker): only with --force
        """
        folder = self.stage_dir(stage)
        if not folder.is_dir() or not any(p.name != MARKER for p in folder.iterdir()):
            return EMPTY
        marker = self.read_marker(stage)
        if marker is None:
            return FOREIGN
        theirs = marker.get("fingerprint")
        if theirs == fingerprint:
            return OWN
        ends = [end for start, end in self.attempts(stage) if start.get("fingerprint") == theirs]
        if any(end and end.get("state") == "done" for end in ends):
            return OTHER_DONE
        if ends and ends[-1] and ends[-1].get("state") == "failed":
            return FAILED_LEFTOVERS
        return OTHER_PARTIAL

    def write_log(self, name: str, text: str) -> Path:
        """A log file under RUN_DIR/logs (a traceback kept off the terminal); returns its path."""
        path = self.path / "logs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    # Stage folders say which fingerprint their files belong to, so a rerun can tell its own partial
    # data (resume) from another run's (refuse unless --force).
    def read_marker(self, stage: str) -> dict[str, Any] | None:
        p = self.stage_dir(stage) / MARKER
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def write_marker(self, stage: str, fingerprint: str) -> None:
        atomic.write_json(
            self.stage_dir(stage) / MARKER, {"stage": stage, "fingerprint": fingerprint, "created": now_iso()}
        )

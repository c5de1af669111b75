"""Writes that matter are atomic: a temp file in the same directory, fsync, rename.

A reader (or a resumed run) therefore sees either the old file or the whole new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode(directory: bool) -> int:
    """mkstemp/mkdtemp create 0600/0700; the final file gets the mode a plain open() would give it, so an
    exported drafter or a cached model stays readable by the serving user."""
    return (0o777 if directory else 0o666) & ~_umask()


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still write on the filesystem of ``path`` (or of its nearest existing parent)."""
    p = Path(path)
    probe = next((q for q in (p, *p.parents) if q.exists()), Path("/"))
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def _is_wrapped_disk_full(err: BaseException, path: Path) -> bool:
    """torch.save and safetensors report a full disk as their own RuntimeError; recognise it by its text, or by
    a filesystem with next to no space left."""
    text = str(err)
    if "No space left" in text or "os error 28" in text:
        return True
    try:
        return "write" in text.lower() and free_bytes(path) < (1 << 20)
    except OSError:
        return False


@contextlib.contextmanager
def naming_file(path: str | os.PathLike, tmp: str | os.PathLike | None = None) -> Iterator[None]:
    """Inside, an OSError always names ``path`` (a failed write() on an open file names no file; one inside the
    temp file or folder ``tmp`` is named by where it was going), and a library's wrapped "no space left" becomes
    the OSError(ENOSPC) it stands for — so the message can say which file."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        elif tmp is not None and str(err.filename).startswith(str(tmp)):
            err.filename = str(path) + str(err.filename)[len(str(tmp)) :]
        raise
    except Exception as err:
        if _is_wrapped_disk_full(err, Path(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with naming_file(path, tmp_path):
            yield tmp_path
            with open(tmp_path, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_path, _default_mode(directory=False))
            os.replace(tmp_path, path)
            fsync_dir(path.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success fsync its files and swap it in for ``path``.

    An existing ``path`` is replaced only after the new one is complete (old moved aside, new renamed
    in, old removed), so a kill at any point leaves a complete directory under ``path`` or its backup.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        with naming_file(path, tmp):
            yield tmp
            _commit_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _commit_dir(tmp: Path, path: Path) -> None:
    """fsync the finished temp folder, then swap it in for ``path`` (the old one moved aside first)."""
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(f, _default_mode(directory=False))
        elif f.is_dir():
            os.chmod(f, _default_mode(directory=True))
    os.chmod(tmp, _default_mode(directory=True))
    fsync_dir(tmp)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

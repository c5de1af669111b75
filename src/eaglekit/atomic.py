"""Writes that matter are atomic: a temp file in the same directory, fsync, rename.

A reader (or a resumed run) therefore sees either the old file or the whole new one, never a torn one. A folder
written whole (a checkpoint, an exported drafter) also carries the sha256 of each of its files (``DIGESTS``), taken
as the write reads them back to fsync them, so that a reader can tell a file whose bytes changed since it was
written (a flipped block, a partial copy) from the one written: ``damage(folder)``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError

# The manifest of a folder written by atomic_dir: {"files": {relative path: {"sha256", "key": file_key}}}. Hidden, so
# that file identities (rundir.file_identity) and the engines loading an exported folder pass it by.
DIGESTS = ".sha256.json"


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


# What torch.save's writer (a C++ stream: "unexpected pos N vs M", "file write failed") and safetensors' (Rust:
# "I/O error: No space left on device (os error 28)") say when a write fails: they raise their own RuntimeError.
TORCH_WRITE_FAILED = re.compile(
    r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed|file write failed|iostream error"
)
OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")
WRAPPED_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT}


def wrapped_errno(err: BaseException, path: Path) -> int | None:
    """The errno a library's own exception stands for when it wraps a failed write (ENOSPC, EDQUOT, ...): read from
    its text or its causes' (Rust's "os error N", the strerror), or, for torch's stream writer, which does not say
    why, ENOSPC when the filesystem of ``path`` has next to no space left."""
    texts = []
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        texts.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = " | ".join(texts)
    if number := OS_ERROR_NUMBER.search(text):
        return int(number.group(1))
    for words, code in WRAPPED_TEXTS.items():
        if words in text:
            return code
    if TORCH_WRITE_FAILED.search(text) or "write" in text.lower():
        try:
            return errno.ENOSPC if free_bytes(path) < (1 << 20) else None
        except OSError:
            return None
    return None


@contextlib.contextmanager
def naming_file(path: str | os.PathLike, tmp: str | os.PathLike | None = None) -> Iterator[None]:
    """Inside, an OSError always names ``path`` (a failed write() on an open file names no file; one inside the
    temp file or folder ``tmp`` is named by where it was going), and a library's wrapped failed write (torch's,
    safetensors', which name no file) becomes the OSError it stands for, naming ``path`` — so the message can say
    where, and why. Wrap the library's call itself to name its file inside a folder being written."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        elif tmp is not None and str(err.filename).startswith(str(tmp)):
            err.filename = str(path) + str(err.filename)[len(str(tmp)) :]
        raise
    except Exception as err:
        code = wrapped_errno(err, Path(path))
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from err


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
def atomic_dir(path: str | os.PathLike, digests: bool = False) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success fsync its files and swap it in for ``path``; with
    ``digests``, a folder read again later (a checkpoint, an exported drafter) also records each file's sha256
    (``DIGESTS``, written last, inside the folder that is swapped in whole).

    An existing ``path`` is replaced only after the new one is complete (old moved aside, new renamed
    in, old removed), so a kill at any point leaves a complete directory under ``path`` or its backup.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        with naming_file(path, tmp):
            yield tmp
            _commit_dir(tmp, path, digests)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _commit_dir(tmp: Path, path: Path, digests: bool) -> None:
    """fsync the finished temp folder (with ``digests``, hashing each file in the same read and writing the
    manifest), then swap it in for ``path`` (the old one moved aside first)."""
    hashed: list[Path] = []
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            os.chmod(f, _default_mode(directory=False))
            if digests and f.name != DIGESTS:  # a nested atomic_dir's manifest is that folder's own
                hashed.append(f)
            else:
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        elif f.is_dir():
            os.chmod(f, _default_mode(directory=True))
    # the files hashed side by side (hashlib releases the GIL): a checkpoint's weights and training state at once
    shas: list[str] = []
    if hashed:
        with ThreadPoolExecutor(max_workers=min(4, len(hashed))) as pool:
            shas = list(pool.map(_sha256_and_fsync, hashed))
    files = {
        f.relative_to(tmp).as_posix(): {"sha256": sha, "key": file_key(f)} for f, sha in zip(hashed, shas, strict=True)
    }
    if digests:
        manifest = tmp / DIGESTS
        manifest.write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")
        _sha256_and_fsync(manifest)
        os.chmod(manifest, _default_mode(directory=False))
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


# ------------------------------------------------------------------------------------------------ digests


def file_key(path: str | os.PathLike) -> list[int]:
    """(size, mtime_ns, inode): what must be unchanged for a digest taken earlier to still be the file's. A rewrite
    gives a new mtime, a copy a new inode; a rename of the folder keeps all three."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def sha256_file(path: str | os.PathLike, block: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _sha256_and_fsync(path: Path, block: int = 16 << 20) -> str:
    """One read of a file just written: its digest, and its bytes made durable."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _digest_of(path: str, _key: tuple[int, ...]) -> str:
    return sha256_file(path)


@dataclass(frozen=True)
class Damage:
    """A file of a folder atomic_dir wrote whose bytes are not those written (or which is gone)."""

    file: Path
    why: str

    def __str__(self) -> str:
        return f"{self.file} {self.why}"


def damage(folder: str | os.PathLike) -> list[Damage]:
    """The files of ``folder`` that differ from what atomic_dir wrote there (none for a folder written without
    digests, by an older eaglekit or another tool).

    A file whose (size, mtime, inode) is the one recorded is trusted without a read, as extract's shard check does;
    any other is hashed (once per process while unchanged) and, when its bytes are the written ones (a copied run
    directory), its new key is recorded so the next check reads nothing.
    """
    folder = Path(folder)
    manifest = folder / DIGESTS
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [Damage(manifest, f"is unreadable ({type(err).__name__}), so the folder's files cannot be checked")]
    found: list[Damage] = []
    moved: dict[str, list[int]] = {}
    for name, entry in files.items():
        path = folder / name
        try:
            key = file_key(path)
        except OSError:
            found.append(Damage(path, "is missing (it was written with this folder)"))
            continue
        if key == entry.get("key"):
            continue
        written = entry.get("key", [None])[0]
        if written is not None and key[0] != written:
            found.append(Damage(path, f"holds {key[0]:,} bytes where {written:,} were written"))
            continue
        sha = _digest_of(str(path), tuple(key))
        if sha != entry.get("sha256"):
            found.append(
                Damage(
                    path,
                    f"changed since it was written (sha256 {sha[:12]}…, recorded {entry.get('sha256', '?')[:12]}…)",
                )
            )
        else:
            moved[name] = key
    if moved and not found:  # best effort: a read-only copy is checked again next time
        with contextlib.suppress(OSError):
            write_json(manifest, {"files": {n: {**e, "key": moved.get(n, e["key"])} for n, e in files.items()}})
    return found


def refuse_damaged(folder: str | os.PathLike, what: str, remedy: str) -> None:
    """Raise naming each damaged file of ``folder`` (``what``: how the message calls it) and ``remedy``."""
    found = damage(folder)
    if found:
        raise EaglekitError(f"{what} {folder} is damaged: " + "; ".join(map(str, found)), remedy)


def damaged_folders(root: str | os.PathLike, depth: int = 2) -> dict[Path, list[Damage]]:
    """Every folder atomic_dir wrote under ``root`` (within ``depth`` levels) whose files are damaged."""
    root = Path(root)
    out: dict[Path, list[Damage]] = {}
    for level in range(depth + 1):
        for manifest in sorted(root.glob("/".join(["*"] * level + [DIGESTS]))):
            if any(part.startswith(".") for part in manifest.parent.relative_to(root).parts):
                continue  # a temp or backup folder of a write in progress
            found = damage(manifest.parent)
            if found:
                out[manifest.parent] = found
    return out

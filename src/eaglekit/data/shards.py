"""Offline feature storage: per token, the target's three aux hidden states and its final normed hidden state.

Bytes per token (``bytes_per_token``), Ht the target's hidden size:

    bfloat16 / float16   8·Ht          aux [3Ht] and last_hidden [Ht], 2 bytes each
    float32              16·Ht
    fp8                  4·Ht + 4      e4m3 values, and one power-of-two scale per state (an int8 exponent)

fp8 scales each of a token's four states on its own (the residual stream grows by orders of magnitude
from the early to the late layers): state ``s`` of token ``t`` is stored as ``e4m3(x / 2**e)`` with
``e = scale_exp[t, s]``, the smallest exponent that brings the state's largest magnitude within e4m3's
±448. A power-of-two scale costs one byte and, e4m3 being a floating-point format, rounds no worse than
an exact float32 scale would (the largest value lands in [224, 448] instead of at 448).

Each shard ``shard-00000.safetensors`` holds ``aux`` [T, 3Ht], ``last_hidden`` [T, Ht], for fp8 also
``scale_exp`` int8 [T, 4] (aux states 0-2, then last_hidden), and ``offsets`` int64 [n+1]; its metadata
holds the sample ids (JSON) in order. Which samples go into which shard is planned up front from the
token store alone (a fixed-seed random mixture per shard, so that training can read a few shards at a
time and still see a representative mix; by length inside a shard, so extraction batches carry little
padding). A shard's header is therefore written first and its rows are streamed in, in any order.

Commit protocol: rows go to a temp file beside the shard; it is fsynced and renamed into place, then
its sidecar ``shard-00000.json`` (ids, lengths, bytes, sha256) is written atomically — a shard exists
once its sidecar does. ``index.json`` lists every shard and is written last, by one process.
``FeatureStore`` reads the index alone at start-up and memory-maps a shard when a sample of it is read.

Content integrity: a shard's bytes are read back and hashed against its sidecar's sha256 before training reads
it (pre-flight) and before extract resumes after it. What was read back is cached in ``.sha256-cache.json``
beside the shards, keyed by each file's (size, mtime_ns, inode), so a rerun rehashes only shards written since.
A shard whose cached digest differs from its sidecar's is not complete: extract re-extracts it, and only it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from eaglekit import atomic, rundir
from eaglekit.errors import EaglekitError
from eaglekit.rundir import sha256_file

FORMAT = "eaglekit.features"
VERSION = "2"
INDEX = "index.json"
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "fp8")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
STATES = 4  # three aux states and the final hidden state
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
PLAN_SEED = "eaglekit.features.shards"
_ST_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
}
DIGEST_CACHE = rundir.DIGEST_CACHE  # a dot name: not a shard or a sidecar to any glob of this module
REMEDY = (
    "delete the named shard and its .json sidecar, then `eaglekit run CONFIG --from extract`: extract "
    "re-extracts only the missing shards (the others are kept) and the stages after it go on"
)


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """What one token's features cost on disk (shard headers and the 8-byte offset per sample come on top)."""
    if dtype not in DTYPE_BYTES:
        raise EaglekitError(f"unknown feature dtype {dtype!r}", f"use one of {', '.join(STORAGE_DTYPES)}")
    scales = STATES if dtype == "fp8" else 0
    return STATES * hidden_size * DTYPE_BYTES[dtype] + scales


def value_dtype(dtype: str) -> torch.dtype:
    """The torch dtype the values of ``aux`` and ``last_hidden`` are stored in."""
    return torch.float8_e4m3fn if dtype == "fp8" else getattr(torch, dtype)


# ----------------------------------------------------------------------------------------- encode/decode


@dataclass
class Rows:
    """Features as stored: ``aux`` [..., 3Ht] and ``last_hidden`` [..., Ht] in the storage dtype, and for fp8
    ``scale_exp`` int8 [..., 4]. A sample's rows, a padded batch of them, or a memory-mapped slice."""

    aux: torch.Tensor
    last_hidden: torch.Tensor
    scale_exp: torch.Tensor | None = None

    def to(self, device) -> Rows:
        # Asynchronous only towards an accelerator: a non-blocking copy to the CPU may still be running when
        # the writer thread reads it.
        async_ok = torch.device(device).type != "cpu"

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=async_ok)

        scale_exp = None if self.scale_exp is None else move(self.scale_exp)
        return Rows(move(self.aux), move(self.last_hidden), scale_exp)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.aux, self.last_hidden, self.scale_exp) if t is not None)


def _fp8_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One state [..., Ht] -> (e4m3 values, int8 exponent [...]) with |x / 2**e| <= 448."""
    amax = x.abs().amax(dim=-1).float()
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127))
    scaled = torch.ldexp(x.float(), -exp.unsqueeze(-1))
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), exp.to(torch.int8)


def encode(aux: torch.Tensor, last_hidden: torch.Tensor, dtype: str) -> Rows:
    """Features [..., 3Ht] and [..., Ht] (any float dtype, any device) in the storage form of ``dtype``."""
    if dtype != "fp8":
        return Rows(aux.to(value_dtype(dtype)), last_hidden.to(value_dtype(dtype)))
    hidden = last_hidden.shape[-1]
    parts = [_fp8_state(s) for s in (*aux.split(hidden, dim=-1), last_hidden)]
    return Rows(torch.cat([p[0] for p in parts[:3]], dim=-1), parts[3][0], torch.stack([p[1] for p in parts], dim=-1))


def decode(rows: Rows, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored features -> (aux [..., 3Ht], last_hidden [..., Ht]) in ``dtype``, on the rows' device."""
    if rows.scale_exp is None:
        return rows.aux.to(dtype), rows.last_hidden.to(dtype)
    hidden = rows.last_hidden.shape[-1]
    exp = rows.scale_exp.to(torch.int32)

    def scaled(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return torch.ldexp(q.float(), e.unsqueeze(-1)).to(dtype)

    aux = torch.cat([scaled(q, exp[..., s]) for s, q in enumerate(rows.aux.split(hidden, dim=-1))], dim=-1)
    return aux, scaled(rows.last_hidden, exp[..., 3])


# ------------------------------------------------------------------------------------------------ plan


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Sample indices per shard: a fixed-seed shuffle cut every ``shard_tokens`` tokens, each shard sorted by length.

    A function of the lengths alone, so a resumed run (with any number of ranks) and the train stage
    rebuild the same plan.
    """
    order = list(range(len(lengths)))
    random.Random(PLAN_SEED).shuffle(order)
    shards, current, tokens = [], [], 0
    for i in order:
        current.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return [sorted(s, key=lambda i: (lengths[i], i)) for s in shards]


def plan_batches(samples: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples (already sorted by length) per batch: padded size at most ``batch_tokens``."""
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in samples:
        w = max(width, lengths[i])
        if current and w * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------------- layout


def _tensors(n_samples: int, tokens: int, hidden: int, dtype: str) -> list[tuple[str, torch.dtype, list[int]]]:
    values = value_dtype(dtype)
    out = [("aux", values, [tokens, 3 * hidden]), ("last_hidden", values, [tokens, hidden])]
    if dtype == "fp8":
        out.append(("scale_exp", torch.int8, [tokens, STATES]))
    return out + [("offsets", torch.int64, [n_samples + 1])]


def _nbytes(dt: torch.dtype, shape: list[int]) -> int:
    n = torch.empty(0, dtype=dt).element_size()
    for s in shape:
        n *= s
    return n


def header_bytes(ids: list[str], tokens: int, hidden: int, dtype: str, extra_meta: dict | None = None) -> bytes:
    """The safetensors header of a shard (length prefix included); tensor data follows it."""
    header, start = {}, 0
    for name, dt, shape in _tensors(len(ids), tokens, hidden, dtype):
        end = start + _nbytes(dt, shape)
        header[name] = {"dtype": _ST_DTYPE[dt], "shape": shape, "data_offsets": [start, end]}
        start = end
    header["__metadata__"] = {
        "format": FORMAT,
        "version": VERSION,
        "ids": json.dumps(ids, ensure_ascii=False),
        "dtype": dtype,
        **{k: str(v) for k, v in (extra_meta or {}).items()},
    }
    text = json.dumps(header, ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def shard_bytes(ids: list[str], tokens: int, hidden: int, dtype: str, extra_meta: dict | None = None) -> int:
    return (
        len(header_bytes(ids, tokens, hidden, dtype, extra_meta))
        + tokens * bytes_per_token(hidden, dtype)
        + 8 * (len(ids) + 1)
    )


# --------------------------------------------------------------------------------------------- writing


class ShardWriter:
    """One shard: ``open()`` writes the header into a temp file, ``write(j, rows)`` puts sample j's rows at
    their planned offset (any order), ``commit()`` fsyncs, renames and writes the sidecar; ``abort()`` drops
    the temp file. Also a context manager (commit on success, abort on error)."""

    def __init__(
        self, path: Path, ids: list[str], lengths: list[int], hidden: int, dtype: str, extra_meta: dict | None = None
    ):
        self.path, self.ids, self.lengths, self.hidden, self.dtype = Path(path), ids, lengths, hidden, dtype
        self.tokens = sum(lengths)
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self.header = header_bytes(ids, self.tokens, hidden, dtype, extra_meta)
        self.layout: dict[str, tuple[int, int]] = {}  # tensor name -> (file offset of its data, bytes per token)
        base = len(self.header)
        for name, dt, shape in _tensors(len(ids), self.tokens, hidden, dtype):
            self.layout[name] = (base, _nbytes(dt, shape[1:]))
            base += _nbytes(dt, shape)
        self.written = [False] * len(ids)
        self.bytes_written = 0
        self._ctx: contextlib.AbstractContextManager[Path] | None = None
        self._f: BinaryIO | None = None

    def open(self) -> ShardWriter:
        self._ctx = atomic.atomic_path(self.path)
        tmp = self._ctx.__enter__()
        # The file stays open across write() calls until commit() or abort() closes it.
        self._f = open(tmp, "r+b")  # noqa: SIM115
        self._f.write(self.header)
        self._f.seek(self.layout["offsets"][0])
        self._f.write(torch.tensor(self.starts, dtype=torch.int64).numpy().tobytes())
        self._tmp = tmp
        return self

    def _opened(self) -> tuple[contextlib.AbstractContextManager[Path], BinaryIO]:
        if self._ctx is None or self._f is None:
            raise RuntimeError(f"ShardWriter {self.path.name}: open() it first (or use it as a context manager)")
        return self._ctx, self._f

    def write(self, j: int, rows: Rows) -> None:
        """Sample ``j`` (its position in this shard): rows as ``encode`` made them, ``lengths[j]`` tokens."""
        n = self.lengths[j]
        expect = {"aux": (n, 3 * self.hidden), "last_hidden": (n, self.hidden), "scale_exp": (n, STATES)}
        tensors = {"aux": rows.aux, "last_hidden": rows.last_hidden, "scale_exp": rows.scale_exp}
        _, f = self._opened()
        for name in self.layout:
            if name == "offsets":
                continue
            t = tensors[name]
            if t is None or tuple(t.shape) != expect[name]:
                raise EaglekitError(
                    f"{self.path.name}: sample {self.ids[j]!r} got {name} "
                    f"{None if t is None else tuple(t.shape)}; expected {expect[name]} "
                    f"(feature dtype {self.dtype})"
                )
            base, per_token = self.layout[name]
            data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()
            f.seek(base + self.starts[j] * per_token)
            f.write(data.tobytes())
            self.bytes_written += data.nbytes
        self.written[j] = True

    def commit(self) -> dict:
        """Make the shard durable and visible; returns its sidecar entry."""
        if not all(self.written):
            missing = self.ids[self.written.index(False)]
            self.abort()
            raise EaglekitError(f"{self.path.name}: sample {missing!r} was never written (a bug in the extract loop)")
        ctx, f = self._opened()
        f.close()
        self.bytes, self.sha256 = os.path.getsize(self._tmp), sha256_file(self._tmp)
        ctx.__exit__(None, None, None)  # fsync, rename, fsync the folder
        entry = self.entry()
        atomic.write_json(sidecar_path(self.path), entry)
        return entry

    def abort(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        if self._ctx is not None:
            with contextlib.suppress(RuntimeError):
                self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)
            self._ctx = None

    def __enter__(self) -> ShardWriter:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def entry(self) -> dict:
        return {
            "file": self.path.name,
            "samples": len(self.ids),
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "ids": self.ids,
            "lengths": self.lengths,
        }


# ----------------------------------------------------------------------------------- content integrity
# The run's one hash cache (rundir.hash_files), kept in the extract folder and keyed by shard file name.


def read_digest_cache(folder: Path) -> dict[str, dict]:
    """{shard file name: {"key": [size, mtime_ns, inode], "sha256": what its bytes hashed to}}."""
    return rundir.read_digest_cache(Path(folder) / DIGEST_CACHE)


def cached_digest(shard: Path, cache: dict[str, dict]) -> str | None:
    """The sha256 the shard's bytes had when last read back, if the file is unchanged since."""
    return rundir.cached_digest(cache, shard.name, shard)


@dataclass(frozen=True)
class Mismatch:
    """A shard whose bytes do not hash to the sha256 its sidecar recorded when extract wrote it."""

    file: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.file}: sha256 {self.actual}, its sidecar records {self.expected}"


def _recorded_sha256(shard: Path) -> str | None:
    try:
        return json.loads(sidecar_path(shard).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None


def known_mismatch(shard: Path, cache: dict[str, dict] | None = None) -> Mismatch | None:
    """A mismatch that an earlier read-back found and the file still has (no hashing)."""
    actual = cached_digest(shard, read_digest_cache(shard.parent) if cache is None else cache)
    expected = _recorded_sha256(shard)
    if actual is None or expected is None or actual == expected:
        return None
    return Mismatch(shard.name, expected, actual)


def verify_contents(folder: Path, files: list[str], workers: int = 4) -> tuple[list[Mismatch], int]:
    """Hash each listed shard (that has a sidecar) against its sidecar's sha256: (mismatches, bytes hashed now).
    Unchanged shards take their digest from the cache, the others are read (rundir.hash_files)."""
    folder = Path(folder)
    digests, hashed = rundir.hash_files(
        folder / DIGEST_CACHE, {name: folder / name for name in files}, "feature shards", workers
    )
    mismatches = []
    for name in files:
        expected = _recorded_sha256(folder / name)
        if name in digests and expected is not None and digests[name] != expected:
            mismatches.append(Mismatch(name, expected, digests[name]))
    return mismatches, hashed


def complete_shard(shard: Path) -> dict | None:
    """The sidecar entry of a finished shard whose file has the recorded size and is not known to differ from
    its sha256 (a read-back found it so: see verify_contents), else None."""
    try:
        entry = json.loads(sidecar_path(shard).read_text())
    except (OSError, ValueError):
        return None
    if not shard.is_file() or shard.stat().st_size != entry.get("bytes"):
        return None
    read_back = cached_digest(shard, read_digest_cache(shard.parent))
    return None if read_back is not None and read_back != entry.get("sha256") else entry


def validate_shards(folder: Path, full_sha: bool = True) -> tuple[list[dict], list[str]]:
    """Check every shard that has a sidecar: (entries that are sound, a message per damaged shard). Sizes
    always; with ``full_sha`` the bytes against the sidecar's sha256 too (verify_contents, cached)."""
    sized, problems = [], []
    for side in sorted(Path(folder).glob("shard-*.json")):
        shard = side.with_suffix(".safetensors")
        try:
            entry = json.loads(side.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{side.name} is unreadable ({err})")
            continue
        if not shard.is_file():
            problems.append(f"{shard.name} is missing (its sidecar says {entry.get('bytes')} bytes)")
        elif shard.stat().st_size != entry.get("bytes"):
            problems.append(
                f"{shard.name} is truncated or damaged: {shard.stat().st_size} bytes, "
                f"the index says {entry.get('bytes')}"
            )
        else:
            sized.append(entry)
    if not full_sha:
        return sized, problems
    differ = {m.file: m for m in verify_contents(Path(folder), [e["file"] for e in sized])[0]}
    problems += [str(differ[e["file"]]) for e in sized if e["file"] in differ]
    return [e for e in sized if e["file"] not in differ], problems


def write_index(folder: Path, shards: list[dict], meta: dict) -> None:
    """The manifest of a finished extraction; refuses a sample stored twice."""
    seen: dict[str, str] = {}
    for s in shards:
        for sid in s["ids"]:
            if sid in seen:
                raise EaglekitError(
                    f"sample {sid!r} is stored in both {seen[sid]} and {s['file']}",
                    f"a bug in eaglekit's shard plan: remove {folder} and rerun extraction "
                    "(`eaglekit run CONFIG --from extract`), and please report it",
                )
            seen[sid] = s["file"]
    atomic.write_json(
        Path(folder) / INDEX,
        {
            "format": FORMAT,
            "version": VERSION,
            **meta,
            "samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": shards,
        },
    )


# --------------------------------------------------------------------------------------------- reading


@dataclass
class _Where:
    shard: int
    start: int
    end: int


class FeatureStore:
    """Read features by sample id: ``store[id] -> Rows`` (memory-mapped slices in the storage dtype).

    Start-up reads ``index.json`` only; a shard is opened (memory-mapped, its header checked against the
    index) when one of its samples is first read, and at most ``max_open`` shards stay open.
    """

    def __init__(self, folder: str | os.PathLike, max_open: int = 16):
        self.folder = Path(folder)
        index_path = self.folder / INDEX
        try:
            self.index = json.loads(index_path.read_text())
        except (OSError, ValueError) as err:
            raise EaglekitError(
                f"{index_path} is missing or unreadable ({err})",
                "run extraction (extract.mode: offline): `eaglekit run CONFIG --from extract`",
            ) from None
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise EaglekitError(
                f"{index_path}: not an eaglekit feature index of version {VERSION} "
                f"(found {self.index.get('format')!r} version {self.index.get('version')!r})",
                "rerun extraction: `eaglekit run CONFIG --from extract --force`",
            )
        self.hidden_size = int(self.index["hidden_size"])
        self.dtype = self.index.get("dtype", "bfloat16")
        self.shards = self.index["shards"]
        self.files = [self.folder / s["file"] for s in self.shards]
        self.max_open = max_open
        self._open: OrderedDict[int, object] = OrderedDict()
        self.where: dict[str, _Where] = {}
        for n, s in enumerate(self.shards):
            start = 0
            for sid, length in zip(s["ids"], s["lengths"], strict=False):
                self.where[sid] = _Where(n, start, start + length)
                start += length

    def _file(self, n: int):
        if n in self._open:
            self._open.move_to_end(n)
            return self._open[n]
        path = self.files[n]
        try:
            f = safe_open(str(path), framework="pt")
            meta = f.metadata() or {}
            offsets = f.get_tensor("offsets").tolist()
        except (SafetensorError, OSError) as err:
            raise EaglekitError(f"{path}: unreadable feature shard ({err})", REMEDY) from None
        entry = self.shards[n]
        expect = [0]
        for length in entry["lengths"]:
            expect.append(expect[-1] + length)
        if (
            meta.get("ids") is None
            or json.loads(meta["ids"]) != entry["ids"]
            or offsets != expect
            or meta.get("dtype", self.dtype) != self.dtype
        ):
            raise EaglekitError(f"{path}: its samples or layout differ from what {INDEX} says", REMEDY)
        self._open[n] = f
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return f

    def __getstate__(self):  # DataLoader workers and prefetch threads re-open the files themselves
        return {**self.__dict__, "_open": OrderedDict()}

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.where

    def shard_members(self) -> list[list[str]]:
        """The sample ids of each shard, in shard order (training reads a few shards at a time)."""
        return [list(s["ids"]) for s in self.shards]

    def __getitem__(self, sample_id: str) -> Rows:
        w = self.where.get(sample_id)
        if w is None:
            raise EaglekitError(
                f"sample {sample_id!r} has no features in {self.folder}",
                "the features are from other prepared tokens: rerun extraction: `eaglekit run CONFIG --from extract --force`",
            )
        f = self._file(w.shard)
        exp = f.get_slice("scale_exp")[w.start : w.end] if self.dtype == "fp8" else None
        return Rows(f.get_slice("aux")[w.start : w.end], f.get_slice("last_hidden")[w.start : w.end], exp)

    def features(self, sample_id: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample's (aux [L, 3Ht], last_hidden [L, Ht]), decoded to ``dtype``."""
        return decode(self[sample_id], dtype)

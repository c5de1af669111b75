"""Offline feature storage, the tensors: encoding a token's states (bf16, fp16, float32 or fp8), the shard writer and
``FeatureStore``, which reads the index alone at start-up and memory-maps a shard when a sample of it is read. The
files themselves — the format and bytes per token, the shard plan, the commit protocol, sidecars, digests and the
index — are ``eaglekit.data.shard_files``, which needs no torch.

fp8 scales each of a token's four states on its own (the residual stream grows by orders of magnitude
from the early to the late layers): state ``s`` of token ``t`` is stored as ``e4m3(x / 2**e)`` with
``e = scale_exp[t, s]``, the smallest exponent that brings the state's largest magnitude within e4m3's
±448. A power-of-two scale costs one byte and, e4m3 being a floating-point format, rounds no worse than
an exact float32 scale would (the largest value lands in [224, 448] instead of at 448).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from eaglekit import atomic

# the files' part, kept importable from here (`sh.shard_name`): its readers need no torch
from eaglekit.data.shard_files import DIGEST_CACHE as DIGEST_CACHE
from eaglekit.data.shard_files import (
    FORMAT,
    INDEX,
    REMEDY,
    STATES,
    VERSION,
    header_bytes,
    sidecar_path,
    tensor_bytes,
    tensor_layout,
)
from eaglekit.data.shard_files import bytes_per_token as bytes_per_token
from eaglekit.data.shard_files import complete_shard as complete_shard
from eaglekit.data.shard_files import known_mismatch as known_mismatch
from eaglekit.data.shard_files import plan_batches as plan_batches
from eaglekit.data.shard_files import plan_shards as plan_shards
from eaglekit.data.shard_files import read_digest_cache as read_digest_cache
from eaglekit.data.shard_files import shard_bytes as shard_bytes
from eaglekit.data.shard_files import shard_name as shard_name
from eaglekit.data.shard_files import validate_shards as validate_shards
from eaglekit.data.shard_files import verify_contents as verify_contents
from eaglekit.data.shard_files import write_index as write_index
from eaglekit.errors import EaglekitError
from eaglekit.rundir import sha256_file

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


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
        for name, _, size, shape in tensor_layout(len(ids), self.tokens, hidden, dtype):
            self.layout[name] = (base, tensor_bytes(size, shape[1:]))
            base += tensor_bytes(size, shape)
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

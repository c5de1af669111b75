"""Offline feature storage: the target's aux hidden states and final normed hidden state, per token, in shards.

Each shard ``shard-00000.safetensors`` holds ``aux`` [T, 3*Ht], ``last_hidden`` [T, Ht] (in
``extract.dtype``) and ``offsets`` int64 [n+1]; its metadata holds the sample ids (JSON) in order. Which
samples go into which shard is planned up front from the token store alone, so a shard's header can be
written first and its rows streamed in batch by batch (memory stays one batch, whatever the shard size),
and a resumed run — with any number of ranks — rebuilds the same plan.

A shard counts as complete once its sidecar ``shard-00000.json`` (file, samples, tokens, bytes, sha256)
exists: the shard is renamed into place before the sidecar is written, both atomically. ``index.json``
lists all shards and is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eaglekit import atomic
from eaglekit.errors import EaglekitError

FORMAT = "eaglekit.features"
VERSION = "1"
INDEX = "index.json"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
REMEDY = "delete the named shard and its .json sidecar, then rerun `eaglekit extract CONFIG`: it re-extracts missing shards"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Feature bytes stored per token: aux [3H] + final hidden [H]. ``fp8``: one byte each plus a float32 scale
    per token for each of the four hidden states (three aux layers, the final one)."""
    if dtype == "fp8":
        return 4 * hidden_size + 4 * 4
    return 4 * hidden_size * DTYPE_BYTES[dtype]


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Sample indices per shard: samples sorted by length (less padding per batch), cut every ``shard_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards, current, tokens = [], [], 0
    for i in order:
        current.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def plan_batches(samples: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples (already sorted by length) per batch: padded size at most ``batch_tokens``."""
    batches, current, width = [], [], 0
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


def header_bytes(ids: list[str], tokens: int, hidden: int, dtype: torch.dtype, extra_meta: dict | None = None) -> bytes:
    """The safetensors header of a shard (length prefix included); tensor data follows it."""
    elt = torch.empty(0, dtype=dtype).element_size()
    aux_size, last_size = tokens * 3 * hidden * elt, tokens * hidden * elt
    header = {
        "aux": {"dtype": _ST_DTYPE[dtype], "shape": [tokens, 3 * hidden], "data_offsets": [0, aux_size]},
        "last_hidden": {"dtype": _ST_DTYPE[dtype], "shape": [tokens, hidden],
                        "data_offsets": [aux_size, aux_size + last_size]},
        "offsets": {"dtype": "I64", "shape": [len(ids) + 1],
                    "data_offsets": [aux_size + last_size, aux_size + last_size + 8 * (len(ids) + 1)]},
        "__metadata__": {"format": FORMAT, "version": VERSION, "ids": json.dumps(ids, ensure_ascii=False),
                         **{k: str(v) for k, v in (extra_meta or {}).items()}},
    }
    text = json.dumps(header, ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def shard_bytes(ids: list[str], tokens: int, hidden: int, dtype: torch.dtype, extra_meta: dict | None = None) -> int:
    elt = torch.empty(0, dtype=dtype).element_size()
    return len(header_bytes(ids, tokens, hidden, dtype, extra_meta)) + tokens * 4 * hidden * elt + 8 * (len(ids) + 1)


def sha256_file(path: Path, block: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class ShardWriter:
    """Stream one shard: header first, then each sample's rows at their planned offsets; atomic on close."""

    def __init__(self, path: Path, ids: list[str], lengths: list[int], hidden: int, dtype: torch.dtype,
                 extra_meta: dict | None = None):
        self.path, self.ids, self.lengths, self.hidden, self.dtype = Path(path), ids, lengths, hidden, dtype
        self.tokens = sum(lengths)
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self.header = header_bytes(ids, self.tokens, hidden, dtype, extra_meta)
        self.elt = torch.empty(0, dtype=dtype).element_size()
        self.written = [False] * len(ids)

    def __enter__(self) -> "ShardWriter":
        self._ctx = atomic.atomic_path(self.path)
        self._tmp = self._ctx.__enter__()
        self._f = open(self._tmp, "r+b")
        self._f.write(self.header)
        aux_end = len(self.header) + self.tokens * 3 * self.hidden * self.elt
        self._last_base = aux_end
        self._f.seek(aux_end + self.tokens * self.hidden * self.elt)
        self._f.write(torch.tensor(self.starts, dtype=torch.int64).numpy().tobytes())
        return self

    def write(self, j: int, aux: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Rows of sample ``j`` (its position in this shard): aux [L, 3Ht], last_hidden [L, Ht]."""
        n = self.lengths[j]
        if tuple(aux.shape) != (n, 3 * self.hidden) or tuple(last_hidden.shape) != (n, self.hidden):
            raise EaglekitError(f"{self.path.name}: sample {self.ids[j]!r} got features {tuple(aux.shape)}, "
                                f"{tuple(last_hidden.shape)}; expected ({n}, {3 * self.hidden}), ({n}, {self.hidden})")
        for t, base, width in ((aux, len(self.header), 3 * self.hidden), (last_hidden, self._last_base, self.hidden)):
            self._f.seek(base + self.starts[j] * width * self.elt)
            self._f.write(t.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).numpy().tobytes())
        self.written[j] = True

    def __exit__(self, exc_type, exc, tb) -> None:
        self._f.close()
        if exc_type is None and not all(self.written):
            missing = self.ids[self.written.index(False)]
            exc = EaglekitError(f"{self.path.name}: sample {missing!r} was never written (a bug in the extract loop)")
            self._ctx.__exit__(type(exc), exc, None)
            raise exc
        if exc_type is None:
            self.bytes, self.sha256 = os.path.getsize(self._tmp), sha256_file(self._tmp)
        self._ctx.__exit__(exc_type, exc, tb)
        if exc_type is None:
            atomic.write_json(sidecar_path(self.path), self.entry())

    def entry(self) -> dict:
        return {"file": self.path.name, "samples": len(self.ids), "tokens": self.tokens, "bytes": self.bytes,
                "sha256": self.sha256}


def complete_shard(shard: Path) -> dict | None:
    """The sidecar entry of a finished shard whose file has the recorded size, else None."""
    try:
        entry = json.loads(sidecar_path(shard).read_text())
    except (OSError, ValueError):
        return None
    return entry if shard.is_file() and shard.stat().st_size == entry.get("bytes") else None


def validate_shards(folder: Path, full_sha: bool = True) -> tuple[list[dict], list[str]]:
    """Check every shard that has a sidecar: (entries that are sound, a message per damaged shard)."""
    good, problems = [], []
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
            problems.append(f"{shard.name} is truncated or damaged: {shard.stat().st_size} bytes, "
                            f"the index says {entry.get('bytes')}")
        elif full_sha and sha256_file(shard) != entry.get("sha256"):
            problems.append(f"{shard.name} has sha256 {sha256_file(shard)[:12]}…, the index says {entry.get('sha256', '')[:12]}…")
        else:
            good.append(entry)
    return good, problems


def write_index(folder: Path, shards: list[dict], meta: dict) -> None:
    atomic.write_json(Path(folder) / INDEX, {"format": FORMAT, "version": VERSION, **meta,
                                             "samples": sum(s["samples"] for s in shards),
                                             "tokens": sum(s["tokens"] for s in shards),
                                             "bytes": sum(s["bytes"] for s in shards), "shards": shards})


@dataclass
class _Where:
    shard: int
    start: int
    end: int


class FeatureStore:
    """Read features by sample id: ``store[id] -> (aux [L, 3Ht], last_hidden [L, Ht])`` (memory-mapped slices)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index_path = self.folder / INDEX
        try:
            self.index = json.loads(index_path.read_text())
        except (OSError, ValueError) as err:
            raise EaglekitError(f"{index_path} is missing or unreadable ({err})",
                                "run `eaglekit extract CONFIG` (extract.mode: offline) to write the features") from None
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise EaglekitError(f"{index_path}: not an eaglekit feature index of version {VERSION}",
                                "rerun extraction: `eaglekit run CONFIG --from extract --force`")
        self.hidden_size = int(self.index["hidden_size"])
        self.files = [self.folder / s["file"] for s in self.index["shards"]]
        self._open: dict[int, object] = {}
        self.where: dict[str, _Where] = {}
        for n, path in enumerate(self.files):
            f = self._file(n)
            offsets = f.get_tensor("offsets").tolist()
            for j, sid in enumerate(json.loads(f.metadata()["ids"])):
                self.where[sid] = _Where(n, offsets[j], offsets[j + 1])

    def _file(self, n: int):
        if n not in self._open:
            try:
                self._open[n] = safe_open(str(self.files[n]), framework="pt")
            except (SafetensorError, OSError) as err:
                raise EaglekitError(f"{self.files[n]}: unreadable feature shard ({err})", REMEDY) from None
        return self._open[n]

    def __getstate__(self):  # DataLoader workers re-open the files themselves
        return {**self.__dict__, "_open": {}}

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.where

    def __getitem__(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.where.get(sample_id)
        if w is None:
            raise EaglekitError(f"sample {sample_id!r} has no features in {self.folder}",
                                "the features are from other prepared tokens: rerun extraction: `eaglekit run CONFIG --from extract --force`")
        f = self._file(w.shard)
        return f.get_slice("aux")[w.start:w.end], f.get_slice("last_hidden")[w.start:w.end]

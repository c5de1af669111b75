"""Offline feature storage as files: per token, the target's three aux hidden states and its final normed hidden
state. This module holds what needs no tensors — the format, sizes, shard plan, sidecars, digests and index — so that
`eaglekit status` and `plan` read them without torch; the tensors' encoding, writer and reader are
``eaglekit.data.shards``.

Bytes per token (``bytes_per_token``), Ht the target's hidden size:

    bfloat16 / float16   8·Ht          aux [3Ht] and last_hidden [Ht], 2 bytes each
    float32              16·Ht
    fp8                  4·Ht + 4      e4m3 values, and one power-of-two scale per state (an int8 exponent)

fp8's per-state power-of-two scales are ``eaglekit.data.shards``' (the encoding).

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

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from eaglekit import atomic, rundir
from eaglekit.errors import EaglekitError

FORMAT = "eaglekit.features"
VERSION = "2"
INDEX = "index.json"
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "fp8")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
STATES = 4  # three aux states and the final hidden state
PLAN_SEED = "eaglekit.features.shards"
# each stored tensor's safetensors dtype and bytes per value: the values by feature dtype, then the fp8 scales
# and the offsets
_VALUES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4), "fp8": ("F8_E4M3", 1)}
_SCALES = ("I8", 1)
_OFFSETS = ("I64", 8)
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


def tensor_layout(n_samples: int, tokens: int, hidden: int, dtype: str) -> list[tuple[str, str, int, list[int]]]:
    """A shard's tensors in file order: (name, safetensors dtype, bytes per value, shape)."""
    values, size = _VALUES[dtype]
    out = [("aux", values, size, [tokens, 3 * hidden]), ("last_hidden", values, size, [tokens, hidden])]
    if dtype == "fp8":
        out.append(("scale_exp", *_SCALES, [tokens, STATES]))
    return out + [("offsets", *_OFFSETS, [n_samples + 1])]


def tensor_bytes(size: int, shape: list[int]) -> int:
    n = size
    for s in shape:
        n *= s
    return n


def header_bytes(ids: list[str], tokens: int, hidden: int, dtype: str, extra_meta: dict | None = None) -> bytes:
    """The safetensors header of a shard (length prefix included); tensor data follows it."""
    header, start = {}, 0
    for name, st_dtype, size, shape in tensor_layout(len(ids), tokens, hidden, dtype):
        end = start + tensor_bytes(size, shape)
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [start, end]}
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

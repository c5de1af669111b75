"""Loading prompt datasets: JSONL / JSON / Parquet / a `datasets` saved folder, in ShareGPT or OpenAI shape.

Every row becomes a PromptRecord whose messages end with the LAST user turn: the assistant turns after it
are dropped because generation writes a fresh reply; earlier assistant turns stay as multi-turn context.
A bad row either stops the load with a UsageError naming ``file:line`` (``on_bad_row="fail"``) or is
counted in ``bad_rows`` (``"skip"``). Problems with the file as a whole (missing, empty, unreadable, no
conversation column) always raise. A JSONL line longer than MAX_LINE_BYTES or nested deeper than
MAX_JSON_DEPTH is a bad row, named like any other. Sources are ``file:N`` for JSONL lines (1-based, as an
editor counts) and ``file:row N`` for JSON lists, Parquet and datasets folders (0-based, as ``ds[N]`` indexes).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eaglekit import atomic
from eaglekit.errors import EaglekitError, UsageError

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
CONVERSATION_KEYS = ("conversations", "messages")
# A JSONL line past this is no prompt (16 MiB is ~4M tokens, beyond any model's context): it is a bad row, read
# past in chunks, never held whole. A prompt row nests ~5 deep (row, turns, turn, content parts, part); past the
# depth bound Python's JSON parser would recurse towards a RecursionError.
MAX_LINE_BYTES = 16 << 20
MAX_JSON_DEPTH = 100
SKIP_REMEDY = (
    "fix or remove that row, or set `data.on_bad_row: skip` in the config "
    "to skip bad rows (they are counted and reported)"
)


@dataclass
class PromptRecord:
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}], ends with a user turn
    source: str  # "file:line" or "file:row N"


@dataclass
class BadRow:
    source: str
    reason: str


@dataclass
class PromptSet:
    records: list[PromptRecord]
    bad_rows: list[BadRow] = field(default_factory=list)
    total_rows: int = 0  # rows read, bad and duplicate ones included
    duplicates: int = 0  # rows skipped because their id or their prompt was seen before
    split: str | None = None  # the split taken from a DatasetDict folder

    def summary(self) -> str:
        parts = [f"{self.total_rows} rows read", f"{len(self.records)} prompts"]
        if self.bad_rows:
            parts.append(f"{len(self.bad_rows)} bad rows skipped")
        if self.duplicates:
            parts.append(f"{self.duplicates} duplicates skipped")
        if self.split:
            parts.append(f"split '{self.split}'")
        return ", ".join(parts)


class _BadRow(Exception):
    """A problem with one row; becomes a UsageError or a BadRow depending on on_bad_row."""


def load_prompts(
    path: str | Path, max_samples: int | None = None, on_bad_row: Literal["fail", "skip"] = "fail"
) -> PromptSet:
    """Read, normalise and de-duplicate the prompts of ``path``; stops after ``max_samples`` good ones."""
    if on_bad_row not in ("fail", "skip"):
        raise UsageError(
            f"on_bad_row must be 'fail' or 'skip', got {on_bad_row!r}", "set data.on_bad_row to fail or skip"
        )
    out = PromptSet(records=[])
    seen_ids: set[str] = set()
    seen_prompts: set[str] = set()
    for source, row in _iter_rows(Path(path), out):
        out.total_rows += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            record = _parse_row(row, source)
        except _BadRow as err:
            if on_bad_row == "fail":
                raise UsageError(f"{source}: {err}", SKIP_REMEDY) from None
            out.bad_rows.append(BadRow(source, str(err)))
            continue
        prompt_key = _messages_hash(record.messages)
        if record.id in seen_ids or prompt_key in seen_prompts:
            out.duplicates += 1
            continue
        seen_ids.add(record.id)
        seen_prompts.add(prompt_key)
        out.records.append(record)
        if max_samples is not None and len(out.records) >= max_samples:
            break
    if out.total_rows == 0:
        raise UsageError(f"{path}: no rows", "pass a prompt file with at least one conversation")
    return out


def peek_prompts(path: str | Path, n: int = 5, on_bad_row: Literal["fail", "skip"] = "fail") -> list[PromptRecord]:
    """The first ``n`` prompts, for the pre-flight check; reads only as far as it needs."""
    return load_prompts(path, max_samples=n, on_bad_row=on_bad_row).records


# --- rows -------------------------------------------------------------------------------------------


def parse_prompt(row: Any, source: str) -> PromptRecord:
    """One row's prompt as load_prompts reads it (its turns up to the last user turn, normalised); raises ValueError
    saying what is wrong with the row."""
    try:
        return _parse_row(row, source)
    except _BadRow as err:
        raise ValueError(str(err)) from None


def _parse_row(row: Any, source: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {_kind(row)}")
    key = next((k for k in CONVERSATION_KEYS if row.get(k) is not None), None)
    if key is None:
        raise _BadRow(f"no 'conversations' or 'messages' field (fields: {', '.join(map(str, row)) or 'none'})")
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise _BadRow(f"'{key}' must be a non-empty list of turns, got {_kind(turns)}")

    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRow(f"{key}[{i}] must be an object with a role and a content, got {_kind(turn)}")
        raw_role = _either(turn, "role", "from")
        if not isinstance(raw_role, str) or raw_role.strip().lower() not in ROLES:
            raise _BadRow(f"{key}[{i}] has unknown role {raw_role!r} (known: {', '.join(ROLES)})")
        messages.append({"role": ROLES[raw_role.strip().lower()], "content": _either(turn, "content", "value")})

    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise _BadRow(f"'{key}' has no user turn, so there is no prompt to answer")
    # Only the kept turns must have text: a dataset may leave the (dropped) final reply empty.
    messages = messages[: last_user + 1]
    for i, m in enumerate(messages):
        m["content"] = _text(m["content"], f"{key}[{i}]")

    raw_id = row.get("id")
    if raw_id is None or raw_id == "":
        sample_id = _messages_hash(messages)[:16]
    elif isinstance(raw_id, str) and not _is_text(raw_id):
        raise _BadRow("'id' holds a lone surrogate escape (e.g. \\ud800), which is no text")
    elif isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool):
        sample_id = str(raw_id)
    else:
        raise _BadRow(f"'id' must be a string or an integer, got {_kind(raw_id)}")
    return PromptRecord(id=sample_id, messages=messages, source=source)


def _either(turn: dict, key: str, alt: str) -> Any:
    # Parquet/Arrow structs carry every key of the column, the unused ones as None.
    return turn[key] if turn.get(key) is not None else turn.get(alt)


def _text(content: Any, where: str) -> str:
    """A turn's text; OpenAI content-part lists are accepted when every part is text."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise _BadRow(f"{where} content must be a string, got {_kind(content)}")
    if not content.strip():
        raise _BadRow(f"{where} has empty content")
    if not _is_text(content):
        raise _BadRow(f"{where} content holds a lone surrogate escape (e.g. \\ud800), which is no text")
    return content


def _is_text(value: str) -> bool:
    # JSON may escape half of a UTF-16 pair; such a string cannot be written as UTF-8 (nor hashed, nor tokenised)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _messages_hash(messages: list[dict]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


# --- files ------------------------------------------------------------------------------------------


def _iter_rows(path: Path, out: PromptSet) -> Iterator[tuple[str, Any]]:
    """Yield (source, row); a row that cannot even be parsed is yielded as a _BadRow."""
    if not path.exists():
        raise UsageError(
            f"prompt data not found: {path}", "set data.prompts to a JSONL/JSON/Parquet file or a datasets folder"
        )
    if path.is_dir():
        yield from _iter_datasets_folder(path, out)
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path)
    elif suffix in (".jsonl", ".ndjson", ".json"):
        yield from _iter_json(path)
    else:
        raise UsageError(
            f"{path}: unknown prompt file type '{suffix or '(none)'}'",
            "use .jsonl (one conversation per line), .json (a list), .parquet, or a datasets saved folder",
        )


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):  # a JSON list of rows: must be parsed whole
        whole = path.read_bytes()
        too_deep = _too_deep_at(whole, MAX_JSON_DEPTH + 1)  # + 1: the list holding the rows
        if too_deep is not None:
            line = whole.count(b"\n", 0, too_deep) + 1
            raise UsageError(
                f"{path}:{line}: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                "a prompt row nests a few levels (turns, content parts): fix or remove that row",
            )
        try:
            rows = json.loads(whole.decode("utf-8-sig"))
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not UTF-8 text", "re-encode the file as UTF-8") from None
        except json.JSONDecodeError as err:
            raise UsageError(
                f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})",
                "fix the JSON syntax there, or write one conversation per line (JSONL)",
            ) from None
        except ValueError as err:  # a number past Python's int() limit of 4300 digits
            raise UsageError(f"{path}: unreadable JSON ({err})", "fix or remove that number") from None
        for i, row in enumerate(rows):
            yield f"{path}:row {i}", row
        return
    with open(path, "rb") as f:  # JSONL, line by line so a huge file is never held whole
        for lineno, raw in enumerate(_bounded_lines(f), start=1):
            source = f"{path}:{lineno}"
            if raw is None:
                yield source, _BadRow(f"line longer than {MAX_LINE_BYTES >> 20} MiB (no prompt is that long)")
                continue
            if not raw.strip():
                continue
            if _too_deep_at(raw, MAX_JSON_DEPTH) is not None:
                yield source, _BadRow(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
                continue
            try:
                yield source, json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
            except UnicodeDecodeError:
                yield source, _BadRow("line is not UTF-8 text")
            except json.JSONDecodeError as err:
                yield source, _BadRow(f"not valid JSON ({err.msg} at column {err.colno})")
            except ValueError as err:  # a number past Python's int() limit of 4300 digits
                yield source, _BadRow(f"unreadable JSON ({err})")


def _bounded_lines(f) -> Iterator[bytes | None]:
    """The lines of a binary file; None for a line longer than MAX_LINE_BYTES, which is read past, not kept."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
            yield None
        else:
            yield raw


# The parts of JSON text that matter for nesting: whole strings (their brackets do not count) and brackets.
_JSON_NESTING = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _too_deep_at(raw: bytes, limit: int) -> int | None:
    """The offset where ``raw``'s JSON nests deeper than ``limit``; None where it does not."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case, without a scan
        return None
    depth = 0
    for m in _JSON_NESTING.finditer(raw):
        token = m.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return m.start()
        elif token in (b"]", b"}"):
            depth -= 1
    return None


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # lazy: heavy (pyarrow)
    import pyarrow.parquet as pq  # lazy: heavy (pyarrow)

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise UsageError(
            f"{path}: not a readable Parquet file ({err})", "re-export the dataset as Parquet or JSONL"
        ) from None
    columns = _columns(path, pf.schema_arrow.names)
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            for item in batch.to_pylist():
                yield f"{path}:row {row}", item
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise UsageError(f"{path}: Parquet data unreadable at row {row} ({err})", "re-export the dataset") from None


def _iter_datasets_folder(path: Path, out: PromptSet) -> Iterator[tuple[str, Any]]:
    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise UsageError(
            f"{path}: a directory that is not a datasets saved folder (no dataset_dict.json or state.json)",
            "pass a JSONL/JSON/Parquet file, or a folder written by Dataset.save_to_disk",
        )
    import datasets  # lazy: heavy (datasets)

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises many kinds here; all mean the same to the user
        raise UsageError(
            f"{path}: cannot load the datasets folder ({type(err).__name__}: {err})",
            "re-save it with Dataset.save_to_disk, or export it as JSONL",
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = "train" if "train" in ds else splits[0] if len(splits) == 1 else None
        if split is None:
            raise UsageError(
                f"{path}: a DatasetDict with splits {splits} and no 'train' split",
                "save the split you want on its own: ds['NAME'].save_to_disk(PATH)",
            )
        out.split, ds = split, ds[split]
    ds = ds.select_columns(_columns(path, ds.column_names))
    for i, row in enumerate(ds):  # Arrow-backed and memory-mapped: rows are read as we go
        yield f"{path}:row {i}", row


def _columns(path: Path, names: list[str]) -> list[str]:
    """The columns to read: the conversation column (required) and the id (optional)."""
    conv = [k for k in CONVERSATION_KEYS if k in names]
    if not conv:
        raise UsageError(
            f"{path}: no 'conversations' or 'messages' column (columns: {', '.join(names) or 'none'})",
            "rename the conversation column to 'conversations' (ShareGPT) or 'messages' (OpenAI)",
        )
    return conv + (["id"] if "id" in names else [])


@functools.lru_cache(maxsize=4)
def _load_prompts_cached(
    path: str, max_samples: int | None, on_bad_row: Literal["fail", "skip"], stamp: tuple
) -> PromptSet:
    return load_prompts(path, max_samples, on_bad_row)


def run_prompts(cfg) -> PromptSet:
    """The run's prompts (``data.*`` of a RunConfig), cached per file state: the pre-flight, the disk estimate
    and the generate stage share one load."""
    d = cfg.data
    return _load_prompts_cached(d.prompts, d.max_samples, d.on_bad_row, _file_state(d.prompts))


def _file_state(path: str | Path) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_size, st.st_ino)


# --- identity ---------------------------------------------------------------------------------------
# A prompt is its id and what is asked (the messages up to the last user turn, normalised): the reply depends on
# nothing else. The file's name, place, format (JSONL, Parquet, ...), row order, the bad rows and duplicates it
# skips and the assistant turns it drops are no part of it, so a renamed or reformatted file is the same prompts
# and a file that gained rows holds the old prompts and some new ones.


def prompt_key(record_id: str, messages: list[dict]) -> str:
    """One prompt's identity: its id and a digest of its messages."""
    return f"{record_id}\t{_messages_hash(messages)[:SHORT_DIGEST]}"


SHORT_DIGEST = 16  # hex digits of a sha256 kept in identities


def set_identity(keys: list[str], path: str | Path) -> dict:
    """A prompt set's identity from its prompts' keys: their count and a digest of the sorted keys; the path is
    kept for messages and the ledger (fingerprints leave it out: ``rundir.content_identity``)."""
    digest = hashlib.sha256("\n".join(sorted(keys)).encode("utf-8")).hexdigest()
    return {"path": str(path), "prompts": len(keys), "sha": digest[:SHORT_DIGEST]}


@functools.lru_cache(maxsize=4)
def _identity_cached(path: str, max_samples: int | None, on_bad_row: str, stamp: tuple) -> dict:
    records = _load_prompts_cached(path, max_samples, on_bad_row, stamp).records
    return set_identity([prompt_key(r.id, r.messages) for r in records], path)


IDENTITY_CACHE = ".prompts-identity.json"  # in the run directory: the identity of the file read last, by its state


def prompts_identity(cfg) -> dict:
    """The identity of the run's prompts as generate asks them (``data.prompts`` read with ``data.max_samples`` and
    ``data.on_bad_row``). A file that cannot be read is identified by its path and the reason (pre-flight's
    prompts check names the problem). A prompts file's identity is kept in the run directory by its path, size,
    mtime and inode, so `eaglekit status` on a 25K-prompt run does not read the prompts again."""
    d = cfg.data
    stamp = _file_state(d.prompts)
    if not stamp:
        return {"path": str(d.prompts), "missing": True}
    cache = Path(cfg.run_path) / IDENTITY_CACHE
    key = [os.path.realpath(d.prompts), *stamp, d.max_samples, d.on_bad_row] if os.path.isfile(d.prompts) else None
    if key is not None:
        try:
            kept = json.loads(cache.read_text())
            if kept.get("key") == key:
                return kept["identity"]
        except (OSError, ValueError, AttributeError, KeyError):
            pass  # none kept yet, or another file's
    try:
        identity = _identity_cached(str(d.prompts), d.max_samples, d.on_bad_row, stamp)
    except UsageError as err:
        return {"path": str(d.prompts), "unreadable": err.message}
    if key is not None and cache.parent.is_dir():
        with contextlib.suppress(OSError, EaglekitError):  # read-only, or full: read again next time
            atomic.write_json(cache, {"key": key, "identity": identity})
    return identity

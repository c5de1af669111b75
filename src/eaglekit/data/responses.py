"""The generate stage's output: ``responses.jsonl`` (one line per complete sample) and ``errors.jsonl``.

Both are append-only. A line is written only when its sample is complete, straight to the file (no
buffer), so a kill -9 loses nothing already written except, at worst, the line being written: on open, a
torn last line (no trailing newline) is cut off and reported, and that sample is generated again. A write
that fails (a full disk) is cut back off the file at once, so the file always ends on a complete record.
fsync runs every few lines and at close, bounding what a power loss can take. An id is never written twice.

When the prompts change under the same generation settings (rows added or removed, ``data.max_samples`` raised or
lowered), the replies to prompts no longer asked move to ``set_aside.jsonl`` (``ResponseStore.set_aside``): later
stages read responses.jsonl alone, and a prompt asked again takes its reply back from there without a request
(``ResponseStore.take_back``). A reply belongs to a prompt by its id and its messages (``prompts.prompt_key``).

Record schema (docs/formats.md §4): ``id, messages, reasoning, content, finish_reason, prompt_tokens,
completion_tokens, reasoning_source, model, server`` (+ ``completion_token_ids`` when known).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglekit import atomic
from eaglekit.data.prompts import prompt_key
from eaglekit.data.reasoning import extract_reasoning, has_think_tags
from eaglekit.errors import EaglekitError
from eaglekit.progress import console
from eaglekit.rundir import now_iso

RESPONSES = "responses.jsonl"
ERRORS = "errors.jsonl"
SET_ASIDE = "set_aside.jsonl"  # replies to prompts no longer asked: kept, not read by later stages


def make_record(
    prompt_id: str,
    messages: list[dict],
    message: dict,
    finish_reason: str | None,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    model: str,
    server: str | None,
    token_ids: list[int] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """A response record from a chat ``message`` (as a server returns it); also returns the fields it carried."""
    reasoning, content, source, seen = extract_reasoning(message)
    record: dict[str, Any] = {  # one JSON line
        "id": prompt_id,
        "messages": messages,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "reasoning_source": source,
        "model": model,
        "server": server,
    }
    if token_ids is not None:
        record["completion_token_ids"] = token_ids
    return record, seen


def _repair_tail(path: Path) -> int:
    """Cut a torn last line (a write interrupted by a kill) off ``path``; returns the bytes dropped."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        # Walk back to the last newline in 64 KiB steps (lines carry whole responses, so they can be long).
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        else:
            keep = 0
        f.truncate(keep)
        os.fsync(f.fileno())
    return size - keep


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL file; a torn last line (no newline: a kill mid-write) is skipped."""
    for lineno, _, row in _raw_lines(path):
        yield lineno, row


def _raw_lines(path: Path) -> Iterator[tuple[int, bytes, dict]]:
    """(line number, the line's bytes, record) of a JSONL file, as ``_lines``."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n") or not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise EaglekitError(
                    f"{path}:{lineno}: not a JSON line ({err}); only a torn last line is repaired "
                    "automatically, so this file was edited or damaged",
                    f"delete line {lineno} and rerun the same command (that sample is generated again)",
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("id"), str):
                raise EaglekitError(
                    f"{path}:{lineno}: not a response record (no string 'id')",
                    f"delete line {lineno} and rerun the same command (that sample is generated again)",
                )
            yield lineno, raw, row


def read_responses(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The records of a ``responses.jsonl``, streamed."""
    path = Path(path)
    if not path.exists():
        raise EaglekitError(f"{path} does not exist", "generate the responses: `eaglekit run CONFIG --until generate`")
    for _, row in _lines(path):
        yield row


class ResponseStore:
    """Append-only store of one run's responses and failures. Use as a context manager."""

    def __init__(self, folder: str | os.PathLike, fsync_every: int = 16, fsync_seconds: float = 5.0):
        self.folder = Path(folder)
        self.path = self.folder / RESPONSES
        self.errors_path = self.folder / ERRORS
        self.fsync_every, self.fsync_seconds = fsync_every, fsync_seconds
        self.done_ids: set[str] = set()
        self.keys: dict[str, str] = {}  # id -> the prompt its reply answers (prompts.prompt_key)
        self.errors: dict[str, dict] = {}  # id -> its last error, for ids not done
        self.duplicates_on_disk = 0
        self._f: io.FileIO | None = None
        self._ef: io.FileIO | None = None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def __enter__(self) -> ResponseStore:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> ResponseStore:
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.errors_path):
            dropped = _repair_tail(path)
            if dropped:
                console.print(
                    f"[yellow]{path.name}: cut off a torn last line ({dropped} bytes) left by an interrupted "
                    "run; that sample will be generated again[/]"
                )
        if self.path.exists():
            for _, row in _lines(self.path):
                if row["id"] in self.done_ids:
                    self.duplicates_on_disk += 1
                    continue
                self.done_ids.add(row["id"])
                self.keys[row["id"]] = _key(row)
        if self.duplicates_on_disk:
            console.print(
                f"[yellow]{self.path}: {self.duplicates_on_disk} lines repeat an earlier id (the first counts); "
                "this file was edited or concatenated[/]"
            )
        if self.errors_path.exists():
            for _, row in _lines(self.errors_path):
                if row["id"] not in self.done_ids:
                    self.errors[row["id"]] = row
        # Both files stay open for the store's life (appends, periodic fsync) until close().
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._ef = open(self.errors_path, "ab", buffering=0)  # noqa: SIM115
        return self

    @property
    def set_aside_path(self) -> Path:
        return self.folder / SET_ASIDE

    def set_aside(self, ids: set[str]) -> int:
        """Move the replies of ``ids`` (prompts no longer asked, or asked otherwise) from responses.jsonl to
        set_aside.jsonl; returns how many. The replies that stay keep their bytes and their order; set_aside.jsonl
        is appended and synced before responses.jsonl is replaced whole (atomic), so a kill leaves each reply in
        one file or both, never in none."""
        ids &= self.done_ids
        if not ids:
            return 0
        self.sync()
        with atomic.atomic_path(self.path) as tmp, open(tmp, "wb") as kept, open(self.set_aside_path, "ab") as aside:
            for _, raw, row in _raw_lines(self.path):
                (aside if row["id"] in ids else kept).write(raw)
            aside.flush()
            os.fsync(aside.fileno())
        f, _ = self._opened()
        f.close()
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115  (the new file, open until close())
        self.done_ids -= ids
        for rid in ids:
            self.keys.pop(rid, None)
        return len(ids)

    def take_back(self, wanted: dict[str, str]) -> int:
        """Append the replies set aside earlier to prompts asked again (``wanted``: id -> prompt key, the prompts
        not done) to responses.jsonl, without a request; returns how many."""
        if not wanted or not self.set_aside_path.exists():
            return 0
        back = 0
        for _, row in _lines(self.set_aside_path):
            rid = row["id"]
            if wanted.get(rid) == _key(row) and rid not in self.done_ids:
                back += self.add(row)
        return back

    def _opened(self) -> tuple[io.FileIO, io.FileIO]:
        """(responses.jsonl, errors.jsonl), open for appending."""
        if self._f is None or self._ef is None:
            raise RuntimeError(f"ResponseStore {self.folder}: open() it first (or use it as a context manager)")
        return self._f, self._ef

    @staticmethod
    def _append(f: io.FileIO, path: Path, line: str) -> None:
        """Append ``line`` whole or not at all: what a failed write (a full disk) put down is cut back off."""
        end = os.fstat(f.fileno()).st_size
        view = memoryview(line.encode("utf-8"))
        try:
            while view:
                view = view[f.write(view) :]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), end)
            err.filename = err.filename or str(path)
            raise

    def add(self, record: dict[str, Any]) -> bool:
        """Append one complete record; False (and nothing written) when its id is already stored."""
        rid = record["id"]
        if rid in self.done_ids:
            return False
        self._append(
            self._opened()[0], self.path, json.dumps(record, ensure_ascii=False) + "\n"
        )  # in the OS's hands now
        self.done_ids.add(rid)
        self.keys[rid] = _key(record)
        self.errors.pop(rid, None)
        self._unsynced += 1
        if self._unsynced >= self.fsync_every or time.monotonic() - self._last_sync >= self.fsync_seconds:
            self.sync()
        return True

    def add_error(self, rid: str, reason: str, attempts: int) -> None:
        row = {"id": rid, "reason": reason, "attempts": attempts, "ts": now_iso()}
        self._append(self._opened()[1], self.errors_path, json.dumps(row, ensure_ascii=False) + "\n")
        self.errors[rid] = row

    def forget_errors(self) -> int:
        """Clear errors.jsonl so its samples are tried again (``--retry-failed``); returns how many there were."""
        n = len(self.errors)
        _, errors_file = self._opened()
        errors_file.truncate(0)
        os.fsync(errors_file.fileno())
        self.errors.clear()
        return n

    def sync(self) -> None:
        for f, path in ((self._f, self.path), (self._ef, self.errors_path)):
            if f is not None and not f.closed:
                try:
                    os.fsync(f.fileno())
                except OSError as err:
                    err.filename = err.filename or str(path)
                    raise
        self._unsynced, self._last_sync = 0, time.monotonic()

    def close(self) -> None:
        self.sync()
        for f in (self._f, self._ef):
            if f is not None:
                f.close()


def _key(row: dict[str, Any]) -> str:
    messages = row.get("messages")
    return prompt_key(row["id"], messages if isinstance(messages, list) else [])


def stored_keys(folder: str | os.PathLike) -> dict[str, str]:
    """id -> the prompt key of each reply in a folder's responses.jsonl (the first line of an id counts); reads
    without repairing anything (pre-flight)."""
    path = Path(folder) / RESPONSES
    keys: dict[str, str] = {}
    if path.exists():
        for _, row in _lines(path):
            keys.setdefault(row["id"], _key(row))
    return keys


def failed_ids(folder: str | os.PathLike) -> set[str]:
    """The ids in a folder's errors.jsonl (samples whose requests failed for good), read without repairing."""
    path = Path(folder) / ERRORS
    return {row["id"] for _, row in _lines(path)} if path.exists() else set()


def summarize(folder: str | os.PathLike) -> dict[str, Any]:
    """Counts over a whole responses.jsonl (for the stage summary and `status`)."""
    folder = Path(folder)
    stats: Counter = Counter()
    sources: Counter = Counter()
    replies: Counter = Counter()
    output_tokens = 0
    ids: set[str] = set()
    if (folder / RESPONSES).exists():
        for row in read_responses(folder / RESPONSES):
            ids.add(row["id"])
            stats["done"] += 1
            sources[row.get("reasoning_source") or "none"] += 1
            stats["empty_reasoning"] += not (row.get("reasoning") or "").strip()
            stats["empty_content"] += not (row.get("content") or "").strip()
            stats["leftover_think"] += has_think_tags(row.get("content") or "")
            stats["length"] += row.get("finish_reason") == "length"
            output_tokens += row.get("completion_tokens") or 0
            replies[hashlib.sha1(f"{row.get('reasoning')}\x00{row.get('content')}".encode()).digest()] += 1
    errors = {row["id"] for _, row in _lines(folder / ERRORS)} if (folder / ERRORS).exists() else set()
    done = stats["done"]  # lines; ids below are unique
    return {
        "done": len(ids),
        "failed": len(errors - ids),
        "empty_reasoning": stats["empty_reasoning"],
        "empty_content": stats["empty_content"],
        "leftover_think": stats["leftover_think"],
        "length_share": round(stats["length"] / done, 4) if done else 0.0,
        "duplicate_replies": sum(c - 1 for c in replies.values()),
        "mean_output_tokens": round(output_tokens / done, 1) if done else 0.0,
        "reasoning_sources": dict(sources),
    }


def quick_counts(folder: str | os.PathLike) -> dict[str, int]:
    """Done and failed samples without parsing the responses (for `status` while a long run writes).

    Failed ids never overlap done ones: ``--retry-failed`` empties errors.jsonl before retrying them.
    """
    folder = Path(folder)
    done = 0
    if (folder / RESPONSES).exists():
        with open(folder / RESPONSES, "rb") as f:
            while chunk := f.read(1 << 20):
                done += chunk.count(b"\n")
    failed = len({row["id"] for _, row in _lines(folder / ERRORS)}) if (folder / ERRORS).exists() else 0
    return {"done": done, "failed": failed}

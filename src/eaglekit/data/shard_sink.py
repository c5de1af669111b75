"""The disk side of extract: a bounded queue and one writer thread that fills shards and commits them.

The extract loop (the target's forward passes, or requests to vLLM) puts encoded rows here and goes on
computing; the writer thread opens a shard when its first rows arrive, writes each sample at its planned
offset and commits the shard (fsync, rename, sidecar) once every sample is in. The queue holds at most
``depth`` items, so memory stays bounded when the disk is the slower side: ``put`` then blocks.

Both sides are timed, so the stage can say which one limited it: time ``put`` spent blocked is time the
computation waited on the disk; time the writer spent waiting for work is time the disk waited on the
computation.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eaglekit.data.shards import Rows, ShardWriter, shard_name

_STOP = object()


class ShardSink:
    """``with ShardSink(folder, shards, hidden, dtype, meta) as sink: sink.put(n, [(j, rows), ...])``.

    ``shards`` maps shard number -> (sample ids, lengths) for the shards this process writes. Leaving the
    block normally waits for every shard to be committed (and raises if any sample is missing); leaving it
    by an exception drops the shards that are still open — committed ones stay.
    """

    def __init__(
        self,
        folder: Path,
        shards: dict[int, tuple[list[str], list[int]]],
        hidden: int,
        dtype: str,
        meta: dict,
        depth: int = 4,
        on_commit: Callable[[int, dict], None] | None = None,
    ):
        self.folder, self.shards, self.hidden, self.dtype, self.meta = Path(folder), shards, hidden, dtype, meta
        self.on_commit = on_commit
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.open: dict[int, ShardWriter] = {}
        self.remaining = {n: len(ids) for n, (ids, _) in shards.items()}
        self.committed: dict[int, dict] = {}
        self.error: BaseException | None = None
        self.put_blocked = 0.0  # seconds the producer waited for room in the queue (the disk was behind)
        self.writer_busy = 0.0  # seconds the writer spent writing and committing
        self.writer_idle = 0.0  # seconds the writer waited for rows (the computation was behind)
        self.bytes = 0
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="eaglekit-shard-writer", daemon=True)

    # --- producer side ----------------------------------------------------------------------------

    def __enter__(self) -> ShardSink:
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def put(self, n: int, rows: list[tuple[int, Rows]]) -> None:
        """Rows of shard ``n``: (position of the sample in the shard, its encoded rows) pairs."""
        self._raise_writer_error()
        t = time.monotonic()
        while True:
            try:
                self.queue.put((n, rows), timeout=0.5)
                break
            except queue.Full:
                self._raise_writer_error()
        self.put_blocked += time.monotonic() - t

    def _raise_writer_error(self) -> None:
        if self.error is not None:
            raise self.error

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._stop(drain=False)
            return
        self._stop(drain=True)
        self._raise_writer_error()
        unfinished = sorted(set(self.shards) - set(self.committed))
        if unfinished:
            n = unfinished[0]
            raise RuntimeError(
                f"{shard_name(n)}: {self.remaining[n]} of its samples never arrived (a bug in the extract loop)"
            )

    def _stop(self, drain: bool) -> None:
        if not drain:
            self.error = self.error or KeyboardInterrupt()  # the writer drops what is queued
        while self.thread.is_alive():
            try:
                self.queue.put(_STOP, timeout=0.5)
                break
            except queue.Full:
                continue
        self.thread.join()

    # --- writer side ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                t = time.monotonic()
                item = self.queue.get()
                self.writer_idle += time.monotonic() - t
                if item is _STOP:
                    break
                if self.error is not None:
                    continue  # stopping after an error: drain without writing
                t = time.monotonic()
                self._write(*item)
                self.writer_busy += time.monotonic() - t
        except BaseException as err:  # reported to the producer at its next put() or at exit
            self.error = err
        finally:
            for writer in self.open.values():
                writer.abort()
            self.open.clear()

    def _write(self, n: int, rows: list[tuple[int, Rows]]) -> None:
        writer = self.open.get(n)
        if writer is None:
            ids, lengths = self.shards[n]
            writer = self.open[n] = ShardWriter(
                self.folder / shard_name(n), ids, lengths, self.hidden, self.dtype, self.meta
            ).open()
        before = writer.bytes_written
        for j, r in rows:
            first = not writer.written[j]
            writer.write(j, r)
            self.remaining[n] -= first  # a sample written twice (a retried request) lands in its one slot
        self.bytes += writer.bytes_written - before
        if self.remaining[n] == 0:
            del self.open[n]
            entry = writer.commit()
            self.committed[n] = entry
            if self.on_commit is not None:
                self.on_commit(n, entry)

    # --- report -----------------------------------------------------------------------------------

    def report(self, tokens: int) -> dict:
        """Both rates and which side limited the run (call after the block has ended)."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        computing = max(wall - self.put_blocked, 1e-9)
        disk_bound = self.put_blocked > 0.1 * wall
        return {
            "compute_tokens_per_s": round(tokens / computing, 1),
            "disk_mb_per_s": round(self.bytes / max(self.writer_busy, 1e-9) / 1e6, 1),
            "written_bytes": self.bytes,
            "bottleneck": "disk" if disk_bound else "compute",
            "compute_waited_on_disk": round(self.put_blocked / wall, 3),
            "disk_idle": round(self.writer_idle / wall, 3),
        }

"""Training features streamed from the vLLM feature servers (``extract.mode: stream``): nothing stored but a spool.

A background thread runs an asyncio loop that walks the run's data order (``RunBatches``) ahead of the optimizer:
for each upcoming micro-batch it requests every sample's hidden states from the servers through the same client
``extract.backend: vllm`` uses (``serving/vllm_features.FeatureClient``: its retries, its rotation of dead or stalled
servers, its checks of each file), encodes them in ``extract.dtype`` exactly as extract would write them, collates
the batch and puts it on a queue of ``extract.stream.ahead`` micro-batches. Bounds:

- disk: a request reserves its file's bytes (tokens × captured states × hidden × the server's bytes per value, learnt
  from the files) from ``SpoolBudget`` before it is sent and gives them back once its file is read and deleted, so
  the servers' files in the storage folder never pass ``extract.stream.spool_gb``; reservations are served in order
  (a long sample is never starved by short ones). With ``extract.stream.transport: mooncake`` the same bound holds
  for the run's objects in the Mooncake store (``serving/mooncake_transport.py``: freed = removed from the store);
- memory: ``ahead`` micro-batches being assembled and ``ahead`` waiting on the queue;
- epochs past the first request the features again, or reuse those kept under ``extract.stream.cache_gb``.

Micro-batch ``u``'s samples are a function of the data order alone, so a run killed with kill -9 and resumed at its
last checkpoint asks for the same samples; which server answered changes nothing but float noise of the engine.
Each request's id carries a prefix of the run directory, so a rerun deletes the files a killed run left behind.

The stream measures who waits: the trainer on an empty queue (server-bound) or the producer on a full one
(trainer-bound), and reports both rates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import hashlib
import itertools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from eaglekit.data.shards import Rows, encode
from eaglekit.errors import EaglekitError
from eaglekit.model.target import read_final_norm
from eaglekit.resolved import ResolvedRun
from eaglekit.serving.client import RequestFailed
from eaglekit.serving.feature_transports import feature_transport
from eaglekit.serving.vllm_features import (
    FeatureClient,
    TransportGone,
    feature_api_key,
    server_bytes_per_token,
    server_dtype,
    server_layer_ids,
)
from eaglekit.training.data import Batch, RunBatches

GB = 1e9
SPOOL_SLACK = 4096  # a request file's safetensors header beyond its states (and its token ids, counted per token)
SAMPLE_EVERY = 0.05  # seconds between two measurements of the spool's real size on disk
NO_SERVER = "no server left"  # how serving.client's outage error begins
HELD_OUT_KEPT = 1 << 30  # held-out rows kept in memory between evaluations up to this (or extract.stream.cache_gb)
FIRST_CHECKED = 3  # the stream's first requests that carry the capture self-check
CHECK_LOGPROBS = 5  # prompt_logprobs they ask per position (as extract's pre-flight smoke request)


class FeatureServersGone(EaglekitError):
    """Every feature server stayed out of rotation past extract.vllm.outage_timeout, or the transport between them and
    this process did (the Mooncake master)."""


def request_prefix(run_dir: str | os.PathLike, rank: int) -> str:
    """The id prefix of this run's requests: the same for a rerun of the run directory (which deletes the files a
    killed attempt left), different for another run sharing the servers."""
    return f"eks{hashlib.sha1(str(run_dir).encode()).hexdigest()[:10]}-r{rank}"


def in_units(n: float, scale: float) -> str:
    """Bytes in GB, or in MB for a spool under 1 GB."""
    return f"{n / GB:,.2f} GB" if scale >= GB else f"{n / 1e6:,.2f} MB"


def flat(entries: list) -> list[int]:
    """The sample indices of a micro-batch's entries (samples, or packed rows of samples)."""
    return [i for entry in entries for i in (entry if isinstance(entry, list) else [entry])]


def rows_bytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for t in (rows.aux, rows.last_hidden, rows.scale_exp) if t is not None)


class SpoolBudget:
    """Bytes the servers' request files may take at once; reservations are granted in the order asked."""

    def __init__(self, limit: int):
        self.limit, self.used, self.peak = limit, 0, 0
        self._tickets = itertools.count()
        self._serving = 0
        self._abandoned: set[int] = set()
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        if n > self.limit:
            raise EaglekitError(
                f"one sample's hidden states take {n / GB:.3f} GB on the spool, more than extract.stream.spool_gb "
                f"({self.limit / GB:g} GB)",
                f"raise extract.stream.spool_gb to at least {math.ceil(n / GB * 10) / 10:g}",
            )
        ticket = next(self._tickets)

        def turn() -> bool:
            while self._serving in self._abandoned:  # a cancelled request's turn passes to the one behind it
                self._abandoned.discard(self._serving)
                self._serving += 1
            return self._serving == ticket and self.used + n <= self.limit

        async with self._changed:
            try:
                await self._changed.wait_for(turn)
            except asyncio.CancelledError:
                self._abandoned.add(ticket)
                self._changed.notify_all()
                raise
            self.used += n
            self._serving += 1
            self.peak = max(self.peak, self.used)
            self._changed.notify_all()

    async def give(self, n: int) -> None:
        async with self._changed:
            self.used -= n
            self._changed.notify_all()


@dataclass
class Clock:
    """Who waited on whom, and how much went through."""

    started: float = 0.0
    trainer_waited: float = 0.0  # the trainer blocked on an empty queue: the servers are behind
    queue_full: float = 0.0  # a batch ready and the queue full: the trainer is behind
    consumed: int = 0
    produced: int = 0
    tokens: int = 0  # the servers answered
    requests: int = 0
    retried: int = 0  # requests that needed more than one attempt (a dead, stalled or broken server)
    cached: int = 0
    spool_peak: int = 0  # bytes of this run's request files on disk, measured
    spool_reserved_peak: int = 0
    in_flight: int = 0
    servers_busy: float = 0.0  # seconds with at least one request in flight: the servers' rate is over these
    busy_since: float = 0.0

    def sent(self) -> None:
        if self.in_flight == 0:
            self.busy_since = time.monotonic()
        self.in_flight += 1

    def answered(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.servers_busy += time.monotonic() - self.busy_since


class FeatureStream:
    """``get(u)``: micro-batch u of the run with its features, requested from the servers ahead of time.

    ``open_client()`` gives an async context manager yielding a client with ``capture(index, token_ids, consume,
    self_check)``, ``held_bytes()`` and ``remove_leftovers()`` (``FeatureClient``). ``first_check(captures)`` runs once
    on the first ``check_samples`` requests of the run, made with ``check_logprobs`` prompt log-probs (the capture
    self-check; it raises to stop the run).
    """

    def __init__(
        self,
        batches: RunBatches,
        open_client: Callable[[], contextlib.AbstractAsyncContextManager],
        dtype: str,
        spool_bytes: int,
        bytes_per_token: int,
        ahead: int = 4,
        cache_bytes: int = 0,
        first_check: Callable[[list], None] | None = None,
        check_samples: int = 0,
        check_logprobs: int = 0,
    ):
        self.batches, self.open_client, self.dtype = batches, open_client, dtype
        self.spool_bytes, self.per_token, self.ahead, self.cache_bytes = (
            spool_bytes,
            bytes_per_token,
            ahead,
            cache_bytes,
        )
        self.first_check, self.check_samples, self.check_logprobs = first_check, check_samples, check_logprobs
        self.store = copy.copy(batches.store)  # the producer thread's own open file
        self.clock = Clock()
        self.cache: dict[str, Rows] = {}
        self.cached_bytes = 0
        self.server_notes: list[str] = []
        self.leftovers_removed = 0
        self._names = itertools.count()  # request ids: unique however often a sample is asked
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next: int | None = None
        self._running: tuple | None = None  # the producer's loop, client and spool budget while it runs

    # --------------------------------------------------------------------------------- the trainer's side

    def get(self, u: int) -> Batch:
        if not self.clock.started:  # both rates over the training window (not the held-out rows asked before it)
            self.clock.started = time.monotonic()
            self.clock.servers_busy, self.clock.tokens = 0.0, 0
        if self._queue is None or u != self._next:
            self._queue = self._start(u)
        t = time.monotonic()
        item = self._queue.get()
        self.clock.trainer_waited += time.monotonic() - t
        self._next = u + 1
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.clock.consumed += 1
        return item

    def fetch(self, indices: list[int]) -> dict[str, Rows]:
        """The features of these samples now (held-out rows), beside the read-ahead: through the producer's own loop,
        client and spool budget while it runs (one bound on the disk), else through a client of their own."""
        running = self._running
        if running is not None:
            loop, client, budget = running
            with contextlib.suppress(concurrent.futures.CancelledError, RuntimeError):  # the producer just ended
                return asyncio.run_coroutine_threadsafe(self._fetch(client, budget, indices), loop).result()

        async def alone() -> dict[str, Rows]:
            async with self.open_client() as client:
                if not self.clock.started:  # nothing of this process is in flight yet: what is there is a killed run's
                    self.leftovers_removed += client.remove_leftovers()
                return await self._fetch(client, SpoolBudget(self.spool_bytes), indices)

        return asyncio.run(alone())

    async def _fetch(self, client, budget: SpoolBudget, indices: list[int]) -> dict[str, Rows]:
        if self.first_check is not None:
            await self._self_check(client, budget, indices)
        rows = await asyncio.gather(*(self._rows(client, budget, i, None) for i in indices))
        return {self.store.ids[i]: r for i, r in zip(indices, rows, strict=True)}

    def held_out_rows(self, entries: list[list]) -> HeldOutRows:
        """The rows of the held-out batches (this rank's entries of each), asked when an evaluation reads them."""
        return HeldOutRows(self, [flat(e) for e in entries], max(self.cache_bytes, HELD_OUT_KEPT))

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread = self._queue = None

    def report(self) -> dict:
        """The rates of both sides and which one held the other back (the stage's counts)."""
        c = self.clock
        elapsed = max(time.monotonic() - c.started, 1e-9) if c.started else 0.0
        trainer_busy = max(elapsed - c.trainer_waited, 1e-9)
        servers_busy = max(c.servers_busy + (time.monotonic() - c.busy_since if c.in_flight else 0.0), 1e-9)
        return {
            "bound": "server-bound" if c.trainer_waited > c.queue_full else "trainer-bound",
            "trainer_micro_batches_per_s": round(c.consumed / trainer_busy, 3),
            "server_micro_batches_per_s": round(c.produced / servers_busy, 3),
            "server_tokens_per_s": round(c.tokens / servers_busy, 1),
            "servers_busy_s": round(servers_busy, 2),
            "trainer_waited_s": round(c.trainer_waited, 2),
            "queue_full_s": round(c.queue_full, 2),
            "seconds": round(elapsed, 2),
            "requests": c.requests,
            "requests_retried": c.retried,
            "reused_from_cache": c.cached,
            "spool_limit_bytes": self.spool_bytes,
            "spool_peak_bytes": c.spool_peak,
            "spool_reserved_peak_bytes": c.spool_reserved_peak,
            "servers_out": self.server_notes,
        }

    def summary(self) -> str:
        r = self.report()
        waited = (
            f"the trainer waited on the servers {r['trainer_waited_s']:g}s"
            if r["bound"] == "server-bound"
            else f"the servers waited on the trainer {r['queue_full_s']:g}s"
        )
        return (
            f"stream: {r['bound']} ({waited}); trainer {r['trainer_micro_batches_per_s']:g} micro-batches/s, servers "
            f"{r['server_micro_batches_per_s']:g} ({r['server_tokens_per_s']:,.0f} tok/s); spool peak "
            f"{in_units(r['spool_peak_bytes'], self.spool_bytes)} of {in_units(self.spool_bytes, self.spool_bytes)} "
            f"(measured on disk); {r['requests']} requests, "
            f"{r['requests_retried']} retried, {r['reused_from_cache']} reused from the cache"
            + "".join(f"; {line}" for line in self.server_notes)
        )

    # ------------------------------------------------------------------------------- the producer's side

    def _start(self, u: int) -> queue.Queue:
        self.close()
        self._stop = threading.Event()
        out: queue.Queue = queue.Queue(maxsize=self.ahead)
        self._thread = threading.Thread(
            target=self._run, args=(u, out, self._stop), daemon=True, name="eaglekit-feature-stream"
        )
        self._thread.start()
        return out

    def _run(self, u: int, out: queue.Queue, stop: threading.Event) -> None:
        try:
            asyncio.run(self._produce(u, out, stop))
        except BaseException as err:  # raised in the training thread by get()
            with contextlib.suppress(queue.Full):
                while not stop.is_set():
                    try:
                        out.put(err, timeout=0.2)
                        return
                    except queue.Full:
                        continue

    async def _produce(self, u: int, out: queue.Queue, stop: threading.Event) -> None:
        async with self.open_client() as client:
            self.leftovers_removed += client.remove_leftovers()
            budget = SpoolBudget(self.spool_bytes)
            sampler = asyncio.create_task(self._measure(client, budget, stop))
            pending: list[asyncio.Task] = []
            self._running = (asyncio.get_running_loop(), client, budget)
            try:
                if self.first_check is not None:
                    await self._self_check(client, budget, flat(self.batches.entries(u)))
                while not stop.is_set():
                    while len(pending) < self.ahead:
                        pending.append(asyncio.create_task(self._assemble(client, budget, u)))
                        u += 1
                    batch = await pending.pop(0)
                    self.clock.produced += 1
                    t = time.monotonic()
                    while not stop.is_set():
                        try:
                            out.put_nowait(batch)
                            break
                        except queue.Full:
                            await asyncio.sleep(0.005)
                    self.clock.queue_full += time.monotonic() - t
            finally:
                self._running = None
                sampler.cancel()
                for task in pending:
                    task.cancel()
                await asyncio.gather(sampler, *pending, return_exceptions=True)
                self.server_notes = client.client.rotation_report() if hasattr(client, "client") else []
                client.remove_leftovers()  # what a stalled server wrote after its request was given up

    async def _measure(self, client, budget: SpoolBudget, stop: threading.Event) -> None:
        while not stop.is_set():
            held = await asyncio.to_thread(client.held_bytes)
            self.clock.spool_peak = max(self.clock.spool_peak, held)
            self.clock.spool_reserved_peak = max(self.clock.spool_reserved_peak, budget.peak)
            await asyncio.sleep(SAMPLE_EVERY)

    async def _self_check(self, client, budget: SpoolBudget, samples: list[int]) -> None:
        """The capture self-check on the run's first few samples, one at a time (each also teaches the spool the
        server's bytes per token before many requests are in flight)."""
        check, self.first_check = self.first_check, None
        assert check is not None
        captures = []
        for i in samples[: self.check_samples]:
            captures.append(await self._capture(client, budget, i, self.check_logprobs))
        await asyncio.to_thread(check, captures)

    async def _assemble(self, client, budget: SpoolBudget, u: int) -> Batch:
        entries = self.batches.entries(u)
        samples = flat(entries)
        rows = await asyncio.gather(*(self._rows(client, budget, i, u) for i in samples))
        features = {self.store.ids[i]: r for i, r in zip(samples, rows, strict=True)}
        return self.batches.collate(entries, self.store, features)

    async def _rows(self, client, budget: SpoolBudget, i: int, u: int | None) -> Rows:
        sid = self.store.ids[i]
        if sid in self.cache:
            self.clock.cached += 1
            return self.cache[sid]
        captured = await self._capture(client, budget, i, 0)
        rows = encode(captured.aux, captured.last_hidden, self.dtype)
        size = rows_bytes(rows)
        if u is not None and self.cached_bytes + size <= self.cache_bytes:
            self.cache[sid], self.cached_bytes = rows, self.cached_bytes + size
        return rows

    async def _capture(self, client, budget: SpoolBudget, i: int, logprobs: int):
        ids = self.store[i][1]
        need = SPOOL_SLACK + len(ids) * self.per_token
        await budget.take(need)
        self.clock.sent()
        try:
            captured = await client.capture(next(self._names), ids.tolist(), self_check=logprobs)
        except RequestFailed as err:
            raise EaglekitError(
                f"stream: sample {self.store.ids[i]!r} failed after {err.attempts} attempts: {err.reason}",
                "check the servers (`eaglekit preflight CONFIG --stage train`), then rerun the same command: it "
                "resumes at the last checkpoint with the same data order",
            ) from None
        except TransportGone as err:
            raise FeatureServersGone(
                f"stream: {err.message}",
                f"{err.remedy}, then rerun the same command: it resumes at the last checkpoint with the same data order",
            ) from None
        except EaglekitError as err:
            if err.message.startswith(NO_SERVER):
                raise FeatureServersGone(
                    f"stream: {err.message}",
                    "restart the feature servers (`eaglekit serve-command CONFIG`), then rerun the same command: it "
                    "resumes at the last checkpoint with the same data order",
                ) from None
            raise
        finally:
            self.clock.answered()
            await budget.give(need)
        self.clock.requests += 1
        self.clock.tokens += len(ids)
        self.clock.retried += captured.attempts > 1
        if captured.bytes > need:  # the server stores more per value than assumed: reserve what it really writes
            self.per_token = math.ceil((captured.bytes - SPOOL_SLACK) / max(len(ids), 1))
        return captured


class HeldOutRows(Mapping[str, Rows]):
    """The held-out rows an evaluation reads, by sample id: asked from the servers one evaluation batch at a time and
    kept while all of them fit in ``keep_bytes`` (then every later evaluation reads memory); a larger held-out set is
    asked again at each evaluation, so its rows never all sit in memory at once (512 Kimi samples of 4,000 tokens
    would be 117 GB)."""

    def __init__(self, stream: FeatureStream, groups: list[list[int]], keep_bytes: int):
        self.stream, self.groups, self.keep_bytes = stream, groups, keep_bytes
        self.group_of = {stream.store.ids[i]: g for g, group in enumerate(groups) for i in group}
        self.rows: dict[str, Rows] = {}
        self.kept_bytes = 0
        self.keep_all = True

    def __getitem__(self, sample_id: str) -> Rows:
        if sample_id not in self.rows:
            fetched = self.stream.fetch(self.groups[self.group_of[sample_id]])
            size = sum(rows_bytes(r) for r in fetched.values())
            if self.keep_all and self.kept_bytes + size > self.keep_bytes:
                self.keep_all = False
            if not self.keep_all:
                self.rows, self.kept_bytes = {}, 0
            self.rows.update(fetched)
            self.kept_bytes += size
        return self.rows[sample_id]

    def __iter__(self):
        return iter(self.group_of)

    def __len__(self) -> int:
        return len(self.group_of)


def open_stream(cfg, run_dir: str | os.PathLike, batches: RunBatches, rank: int, first_check=None) -> FeatureStream:
    """The stream of this config: the FeatureClient of extract.vllm, the bounds of extract.stream. ``first_check
    (captures, layer_ids, norm)`` is the capture self-check, run on the stream's first requests."""
    resolved = ResolvedRun(cfg)  # the stream's one resolution: every reader below takes its figures from it
    source = resolved.feature_source
    hf, aux = resolved.target_and_aux
    layer_ids = server_layer_ids(aux, hf.num_hidden_layers)
    norm, key = read_final_norm(cfg.target), feature_api_key(source)
    prefix = request_prefix(run_dir, rank)
    transport = feature_transport(source)  # one for the stream: a Mooncake client joins the store once
    return FeatureStream(
        batches,
        lambda: FeatureClient(
            source.servers, key, source.served_model, layer_ids, hf.hidden_size, norm, prefix, transport=transport
        ),
        cfg.extract.dtype,
        spool_bytes=int(source.spool_bytes),
        bytes_per_token=server_bytes_per_token(len(layer_ids), hf.hidden_size, server_dtype(hf)),
        ahead=source.stream.ahead,
        cache_bytes=int(resolved.cache_bytes),
        first_check=None if first_check is None else (lambda caps: first_check(caps, layer_ids, norm)),
        check_samples=FIRST_CHECKED,
        check_logprobs=CHECK_LOGPROBS,
    )

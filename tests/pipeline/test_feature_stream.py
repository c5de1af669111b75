"""The feature stream's own logic, without vLLM: the batches it assembles are the data order's, the spool of request
files stays within its bound (measured on disk), epochs past the first re-request or reuse the cache, a kill -9's
leftovers are removed, a failed sample and a pool with no server left are named errors, and the report says who
waited on whom. The client here writes and reads real files in a real folder, as the file spool does; the vLLM
tests (test_stream_vllm.py) run the real engine."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from eaglekit.config import parse_config
from eaglekit.data import shards as sh
from eaglekit.data.tokens import TokenStore, write_token_store
from eaglekit.errors import EaglekitError
from eaglekit.serving.client import RequestFailed
from eaglekit.serving.vllm_features import Captured
from eaglekit.training import stream as st
from eaglekit.training.data import RunBatches, collate

HIDDEN = 4
PER_TOKEN = 4 * HIDDEN * 4 + 8  # the fake server's file: four float32 states and the token id per token


class FileClient:
    """A feature client whose 'server' writes each request's file into ``spool``, waits, and whose reader loads and
    deletes it: the features of a sample are a function of its token ids alone."""

    def __init__(self, spool: Path, prefix: str, delay: float = 0.01, fail: set[int] | None = None, gone=False):
        self.spool, self.prefix, self.delay, self.fail, self.gone = spool, prefix, delay, fail or set(), gone
        self.asked: list[list[int]] = []
        self.opened = 0

    async def __aenter__(self):
        self.opened += 1
        return self

    async def __aexit__(self, *exc):
        return None

    def remove_leftovers(self) -> int:
        found = list(self.spool.glob(f"cmpl-{self.prefix}-*"))
        for p in found:
            p.unlink()
        return len(found)

    def held_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.spool.glob(f"cmpl-{self.prefix}-*") if p.exists())

    async def capture(self, index, token_ids, consume=None, self_check=None):
        if self.gone:
            raise EaglekitError("no server left: every server has been out of rotation for 1s; a: down", "x")
        if token_ids[0] in self.fail:
            raise RequestFailed("http://a/v1: HTTP 500", 6)
        self.asked.append(token_ids)
        path = self.spool / f"cmpl-{self.prefix}-{index}-0-abc.bin"
        path.write_bytes(b"\0" * (len(token_ids) * PER_TOKEN))
        await asyncio.sleep(self.delay)
        size = path.stat().st_size
        path.unlink()
        ids = torch.tensor(token_ids, dtype=torch.float32)[:, None]
        return Captured(ids.expand(-1, 3 * HIDDEN) / 100, ids.expand(-1, HIDDEN) / 100, None, "a", 1, bytes=size)


def features_of(store: TokenStore, i: int) -> sh.Rows:
    ids = store[i][1].float()[:, None]
    return sh.encode(ids.expand(-1, 3 * HIDDEN) / 100, ids.expand(-1, HIDDEN) / 100, "bfloat16")


@pytest.fixture
def run(tmp_path):
    """A token store of 60 samples (lengths 5..24) and the run's batches (4 a micro-batch)."""
    samples = [(f"s{i}", [i + 1] * (5 + i % 20), [1] * (5 + i % 20)) for i in range(60)]
    write_token_store(tmp_path / "tokens.safetensors", samples)
    store = TokenStore(tmp_path / "tokens.safetensors")
    cfg = parse_config(
        {
            "run_dir": "run",
            "target": {"model": "unused"},
            "data": {"prompts": "unused.jsonl", "eval_fraction": 0.1},
            "train": {"batch_size": 4, "seed": 3},
        },
        base_dir=tmp_path,
    )
    blocks = sh.plan_shards(store.lengths.tolist(), 200)
    spool = tmp_path / "spool"
    spool.mkdir()
    return RunBatches(cfg, store, blocks, None, 1, 0), store, spool


def stream_of(batches, client, spool_bytes=10 * (st.SPOOL_SLACK + 24 * PER_TOKEN), **kw):
    return st.FeatureStream(batches, lambda: client, "bfloat16", spool_bytes, PER_TOKEN, **kw)


def test_batches_are_the_data_orders_and_the_spool_stays_within_its_bound(run):
    batches, store, spool = run
    client = FileClient(spool, "p", delay=0.02)
    limit = 3 * (st.SPOOL_SLACK + 24 * PER_TOKEN)  # room for three of the longest samples' files at once
    peak = [0]
    stop = threading.Event()

    def watch():  # the folder's real size, measured from outside the stream
        while not stop.is_set():
            peak[0] = max(peak[0], sum(p.stat().st_size for p in spool.iterdir() if p.exists()))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    stream = stream_of(batches, client, spool_bytes=limit, ahead=3)
    try:
        for u in range(2 * batches.per_epoch + 1):  # into the third epoch
            got = stream.get(u)
            entries = batches.entries(u)
            want = collate(store, entries, {store.ids[i]: features_of(store, i) for i in entries})
            for name in ("input_ids", "attention_mask", "loss_mask", "aux", "last_hidden"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (u, name)
    finally:
        stream.close()
        stop.set()
        watcher.join()
    report = stream.report()
    assert 0 < peak[0] <= limit and report["spool_peak_bytes"] <= limit
    assert report["spool_reserved_peak_bytes"] <= limit
    assert peak[0] > 24 * PER_TOKEN  # more than the longest file: requests were in flight together
    assert len(client.asked) >= 2 * len(batches.train_idx)  # epochs past the first asked again (no cache)
    assert list(spool.iterdir()) == []


def test_a_cache_serves_later_epochs_and_a_resume_starts_where_asked(run):
    batches, store, spool = run
    client = FileClient(spool, "p", delay=0.0)
    stream = stream_of(batches, client, cache_bytes=10**9, ahead=2)
    try:
        for u in range(batches.per_epoch):
            stream.get(u)
        first = len(client.asked)
        later = stream.get(batches.per_epoch + 3)  # a jump (a resume): the read-ahead restarts there
        entries = batches.entries(batches.per_epoch + 3)
        want = collate(store, entries, {store.ids[i]: features_of(store, i) for i in entries})
        assert torch.equal(later.aux, want.aux)
    finally:
        stream.close()
    assert first == len(batches.train_idx)  # each training sample asked once in the first epoch...
    assert len(client.asked) == first  # ...and reused from the cache after it
    assert stream.report()["reused_from_cache"] >= 4


def test_leftovers_of_a_killed_run_are_removed_and_a_failed_sample_is_named(run):
    batches, store, spool = run
    debris = spool / "cmpl-p-17-1-0-deadbeef.safetensors"
    debris.write_bytes(b"torn")
    (spool / "cmpl-other-run-1-1-0-0.safetensors").write_bytes(b"not ours")
    first = batches.entries(0)[0]
    client = FileClient(spool, "p", fail={int(store[first][1][0])})
    stream = stream_of(batches, client)
    with pytest.raises(EaglekitError, match=rf"stream: sample '{store.ids[first]}' failed after 6 attempts"):
        stream.get(0)
    stream.close()
    assert not debris.exists() and (spool / "cmpl-other-run-1-1-0-0.safetensors").exists()
    assert stream.leftovers_removed == 1


def test_no_server_left_is_a_named_error(run):
    batches, _, spool = run
    stream = stream_of(batches, FileClient(spool, "p", gone=True))
    with pytest.raises(st.FeatureServersGone, match="stream: no server left") as err:
        stream.get(0)
    stream.close()
    assert "resumes at the last checkpoint" in (err.value.remedy or "")


def test_a_sample_larger_than_the_spool_is_refused_with_the_size_to_set(run):
    batches, _, spool = run
    stream = stream_of(batches, FileClient(spool, "p"), spool_bytes=1000)
    with pytest.raises(EaglekitError, match="more than extract.stream.spool_gb") as err:
        stream.get(0)
    stream.close()
    assert "raise extract.stream.spool_gb" in (err.value.remedy or "")


def test_the_report_names_the_slower_side(run):
    batches, _, spool = run
    slow_servers = stream_of(batches, FileClient(spool, "p", delay=0.05), ahead=1)
    fast_servers = stream_of(batches, FileClient(spool, "q", delay=0.0), ahead=1)
    try:
        for u in range(6):
            slow_servers.get(u)
        for u in range(6):
            fast_servers.get(u)
            time.sleep(0.05)  # a slow optimizer step
    finally:
        slow_servers.close()
        fast_servers.close()
    assert slow_servers.report()["bound"] == "server-bound"
    assert fast_servers.report()["bound"] == "trainer-bound"
    assert "trainer-bound" in fast_servers.summary()


def test_the_first_requests_carry_the_capture_self_check(run):
    batches, _, spool = run
    seen = []

    class Checked(FileClient):
        async def capture(self, index, token_ids, consume=None, self_check=None):
            seen.append(self_check)
            return await super().capture(index, token_ids, consume, self_check)

    def check(captures):
        raise EaglekitError(f"stream: capture self-check: {len(captures)} captures off by 2 nats", "restart it")

    stream = stream_of(batches, Checked(spool, "p"), first_check=check, check_samples=3, check_logprobs=5)
    with pytest.raises(EaglekitError, match="3 captures off by 2 nats"):
        stream.get(0)
    stream.close()
    assert seen == [5, 5, 5]


def test_the_spool_budget_serves_in_order_and_a_cancelled_turn_passes_on():
    async def scenario():
        budget = st.SpoolBudget(100)
        order = []

        async def ask(name, n):
            await budget.take(n)
            order.append(name)

        await budget.take(60)
        big = asyncio.create_task(ask("big", 80))  # first in line, waits for room
        small = asyncio.create_task(ask("small", 10))  # fits now, but its turn comes after big's
        cancelled = asyncio.create_task(ask("cancelled", 10))
        await asyncio.sleep(0.01)
        assert order == []
        cancelled.cancel()
        await budget.give(60)
        await asyncio.wait_for(asyncio.gather(big, small), 5)
        await asyncio.wait_for(ask("after", 10), 5)  # the cancelled turn did not block the line
        return order, budget

    order, budget = asyncio.run(scenario())
    assert order == ["big", "small", "after"] and budget.used == 100 and budget.peak == 100


def test_every_server_gone_is_a_named_error_after_the_outage_timeout(run):
    """The real FeatureClient and its pool against two ports nobody listens on: both go out of rotation, and once
    extract.vllm.outage_timeout has passed the stream stops with FeatureServersGone (not a hang, not a traceback)."""
    from eaglekit.config import VllmFeaturesConfig
    from eaglekit.model.target import FinalNorm
    from eaglekit.serving.engine import free_port
    from eaglekit.serving.vllm_features import FeatureClient

    batches, _, spool = run
    vcfg = VllmFeaturesConfig(
        servers=[f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}/v1"],
        storage_path=str(spool),
        timeout=2,
        max_retries=50,
        retry_backoff=0.01,
        probe_interval=0.2,
        outage_timeout=1.0,
    )
    norm = FinalNorm(torch.ones(HIDDEN), 1e-6)
    stream = stream_of(batches, None)
    stream.open_client = lambda: FeatureClient(vcfg, None, "m", [2, 4, 5, 8], HIDDEN, norm, "p")
    with pytest.raises(st.FeatureServersGone, match=r"stream: no server left: every server has been out of rotation"):
        stream.get(0)
    stream.close()


def test_held_out_rows_are_asked_per_batch_kept_when_they_fit_and_share_the_running_producer(run):
    batches, store, spool = run
    groups = [st.flat(batches.share(b)) for b in batches.held_out()]
    held = [i for g in groups for i in g]
    assert held

    def read_all(rows):
        for i in held:
            assert torch.equal(rows[store.ids[i]].aux, features_of(store, i).aux)

    client = FileClient(spool, "p")
    stream = stream_of(batches, client)
    kept = stream.held_out_rows([batches.share(b) for b in batches.held_out()])
    read_all(kept)
    read_all(kept)
    assert len(client.asked) == len(held)  # asked once, then read from memory

    client.asked.clear()
    # too small to keep: one evaluation batch (here one sample) in memory at a time, asked again at each evaluation
    asked_again = st.HeldOutRows(stream, [[i] for i in held], keep_bytes=1)
    read_all(asked_again)
    read_all(asked_again)
    assert len(client.asked) == 2 * len(held)

    try:
        stream.get(0)  # the producer runs: a held-out read goes through its loop and client (one spool budget)
        opened = client.opened
        read_all(st.HeldOutRows(stream, groups, keep_bytes=1))
        assert client.opened == opened
    finally:
        stream.close()

"""Training reads offline features as a stream: the index alone at start-up, a few memory-mapped shards at a
time (shards shuffled, samples shuffled within a window), read ahead in a background thread."""

from __future__ import annotations

import pytest
import torch

from eaglekit.data import shards as sh
from eaglekit.training import data as td


def write_shards(folder, n_shards=10, per_shard=20, hidden=8, dtype="bfloat16"):
    """Synthetic shards: sample k of shard n is filled with the value n*1000 + k (so a read shows where it came from)."""
    entries, lengths = [], []
    for n in range(n_shards):
        ids = [f"s{n}-{k}" for k in range(per_shard)]
        lens = [3 + (k % 5) for k in range(per_shard)]
        lengths += lens
        with sh.ShardWriter(folder / sh.shard_name(n), ids, lens, hidden, dtype, {"hidden_size": hidden}) as w:
            for k, length in enumerate(lens):
                value = float(n * 1000 + k) / 1000
                w.write(k, sh.encode(torch.full((length, 3 * hidden), value), torch.full((length, hidden), value), dtype))
        entries.append(w.entry())
    sh.write_index(folder, entries, {"hidden_size": hidden, "aux_layer_ids": [2, 4, 5], "dtype": dtype})
    return lengths


def test_start_up_reads_the_index_only_and_streaming_opens_few_shards(tmp_path, monkeypatch):
    lengths = write_shards(tmp_path)
    opened = []
    real = sh.safe_open
    monkeypatch.setattr(sh, "safe_open", lambda path, **kw: (opened.append(path), real(path, **kw))[1])
    store = sh.FeatureStore(tmp_path, max_open=2)
    assert opened == [] and len(store.where) == 200

    members = store.shard_members()
    position = {sid: i for i, sid in enumerate(sid for ids in members for sid in ids)}
    blocks = [[position[s] for s in ids] for ids in members]
    monkeypatch.setattr(td, "BUCKET_BATCHES", 5)  # a window of 5 batches of 4: one shard's worth of samples
    batches = td.epoch_batches(list(range(200)), lengths, 4, seed=0, epoch=0, blocks=blocks)
    assert sorted(i for b in batches for i in b) == list(range(200))
    shard_of = {i: n for n, b in enumerate(blocks) for i in b}
    for w in range(0, len(batches), 5):  # each window draws from at most the two shards it straddles
        assert len({shard_of[i] for b in batches[w:w + 5] for i in b}) <= 2
    assert batches == td.epoch_batches(list(range(200)), lengths, 4, seed=0, epoch=0, blocks=blocks)  # exact resume
    assert batches != td.epoch_batches(list(range(200)), lengths, 4, seed=0, epoch=1, blocks=blocks)

    ids = [sid for ids in members for sid in ids]
    for b in batches:
        for i in b:
            rows = store[ids[i]]
            n, k = map(int, ids[i][1:].split("-"))
            assert float(rows.aux[0, 0]) == pytest.approx((n * 1000 + k) / 1000, rel=1e-2)
    # streamed: each shard opened about once (a window straddling two shards may reopen one), never per sample
    assert len(opened) <= 2 * len(members)
    assert len(store._open) <= 2


def test_a_shard_that_disagrees_with_the_index_is_named(tmp_path):
    write_shards(tmp_path, n_shards=2)
    other = tmp_path / "other"
    other.mkdir()
    write_shards(other, n_shards=2, per_shard=21)
    (other / sh.shard_name(1)).replace(tmp_path / sh.shard_name(1))  # a shard from another extraction
    store = sh.FeatureStore(tmp_path)
    store["s0-0"]
    with pytest.raises(Exception, match="shard-00001.safetensors: its samples or layout differ"):
        store["s1-0"]


def test_loader_reads_ahead_restarts_and_reports_errors():
    made = []

    def make(u, store, features):
        made.append(u)
        if u == 7:
            raise ValueError("broken sample 7")
        return u * 10

    loader = td.Loader(make, store=None, features=None, ahead=2)
    assert [loader.get(u) for u in (0, 1, 2)] == [0, 10, 20]
    assert loader.get(5) == 50  # a jump (a resumed run) restarts the read-ahead there
    assert loader.get(6) == 60
    with pytest.raises(ValueError, match="broken sample 7"):
        loader.get(7)
    loader.close()
    assert made[:3] == [0, 1, 2] and 5 in made

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
                w.write(
                    k, sh.encode(torch.full((length, 3 * hidden), value), torch.full((length, hidden), value), dtype)
                )
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
        assert len({shard_of[i] for b in batches[w : w + 5] for i in b}) <= 2
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


def test_packing_streams_shard_by_shard_and_carries_fp8_scales(tmp_path, monkeypatch):
    from eaglekit.data.tokens import TokenStore, write_token_store

    lengths = write_shards(tmp_path, n_shards=6, per_shard=20, dtype="fp8")
    store = sh.FeatureStore(tmp_path, max_open=2)
    ids = [sid for ids in store.shard_members() for sid in ids]
    write_token_store(
        tmp_path / "tokens.safetensors", [(sid, list(range(n)), [1] * n) for sid, n in zip(ids, lengths, strict=False)]
    )
    tokens = TokenStore(tmp_path / "tokens.safetensors")
    blocks = [list(range(20 * n, 20 * n + 20)) for n in range(6)]

    # packed rows follow the shards too: a window of 20 samples (one shard's worth) draws from at most two shards
    monkeypatch.setattr(td, "PACK_WINDOW", 20)
    batches = td.packed_batches(list(range(120)), lengths, 2, 16, seed=0, epoch=0, blocks=blocks)
    rows = [row for b in batches for row in b]
    assert sorted(i for row in rows for i in row) == list(range(120))
    assert all(len({i // 20 for i in row}) <= 2 for row in rows)

    # an fp8 packed batch keeps each token's scales beside it: decoded, every document reads its own value
    batch = td.collate_packed(tokens, [[0, 21], [45]], store)
    assert batch.scale_exp is not None and batch.scale_exp.shape[:2] == batch.aux.shape[:2]
    aux, last = sh.decode(sh.Rows(batch.aux, batch.last_hidden, batch.scale_exp))
    starts = {0: (0, 0), lengths[0]: (1, 1)}  # row 0: sample s0-0, then s1-1 from its first token on
    for start, (n, k) in starts.items():
        assert float(aux[0, start, 0]) == pytest.approx((n * 1000 + k) / 1000, rel=2e-2)
        assert float(last[0, start, 0]) == pytest.approx((n * 1000 + k) / 1000, rel=2e-2)
    assert float(aux[1, 0, 0]) == pytest.approx((2 * 1000 + 5) / 1000, rel=2e-2)

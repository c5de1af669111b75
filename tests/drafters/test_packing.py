"""Packing (train.packing): several samples per row give the same loss and gradients as the samples alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_drafter_ttt import VARIANTS, grads, make_drafter, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.target import TargetFeatures
from eaglekit.training.data import collate, collate_packed, packed_batches


def documents(cfg, lengths, seed=0, dtype=torch.float64):
    """Per document: (aux, ids, target_logits, loss_mask, in_draft), as the unpadded tensors of one sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append(
            (
                torch.randn(n, 3 * cfg.target_hidden_size, generator=g, dtype=dtype),
                torch.randint(0, cfg.vocab_size, (n,), generator=g),
                3 * torch.randn(n, cfg.draft_vocab_size, generator=g, dtype=dtype),
                (torch.rand(n, generator=g) < 0.8).long(),
                torch.rand(n, generator=g) < 0.85,
            )
        )
    return out


def lay_out(docs, rows):
    """Rows of documents (lists of indices) -> right-padded [R, W] tensors, attention mask and position ids."""
    width = max(sum(docs[i][1].shape[0] for i in row) for row in rows)
    fields = []
    for f in range(5):
        parts = []
        for row in rows:
            joined = torch.cat([docs[i][f] for i in row])
            pad = torch.zeros(width - joined.shape[0], *joined.shape[1:], dtype=joined.dtype)
            parts.append(torch.cat([joined, pad]))
        fields.append(torch.stack(parts))
    attention = torch.stack([torch.arange(width) < sum(docs[i][1].shape[0] for i in row) for row in rows]).long()
    positions = []
    for row in rows:
        p = torch.cat([torch.arange(docs[i][1].shape[0]) for i in row])
        positions.append(torch.cat([p, p[-1] + 1 + torch.arange(width - p.shape[0])]))
    aux, ids, logits, loss_mask, in_draft = fields
    return aux, ids, logits, loss_mask, attention, in_draft, torch.stack(positions)


@pytest.mark.parametrize("variant", ["llama", "mla-yarn", "mla-no-q-lora-eagle3.1"])
def test_packed_rows_give_the_loss_and_gradients_of_the_samples_alone_float64(variant):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    docs = documents(cfg, [9, 5, 13, 3, 7])
    alone = lay_out(docs, [[i] for i in range(len(docs))])
    packed = lay_out(docs, [[0, 1, 3], [2, 4]])  # two rows, one of them padded at the end

    steps = 4
    want = ttt_loss(drafter, *alone[:5], settings=TTTConfig(steps=steps), target_in_draft=alone[5])
    g_want = grads(drafter, want.loss)
    got = ttt_loss(
        drafter, *packed[:5], settings=TTTConfig(steps=steps), target_in_draft=packed[5], position_ids=packed[6]
    )
    g_got = grads(drafter, got.loss)

    assert got.count_k == want.count_k and all(c > 0 for c in want.count_k)
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-11)
    assert got.loss_k == pytest.approx(want.loss_k, rel=1e-11)
    assert got.acc_k == want.acc_k
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-9, atol=1e-12, msg=name)

    # the same packed row without position ids is one long document: another loss (attention crosses documents)
    leaky = ttt_loss(drafter, *packed[:5], settings=TTTConfig(steps=steps), target_in_draft=packed[5])
    assert leaky.count_k[0] > want.count_k[0] and leaky.loss.item() != pytest.approx(want.loss.item(), rel=1e-9)


def test_position_ids_that_do_not_count_up_are_refused():
    cfg = tiny_config()
    drafter = make_drafter(cfg)
    aux, ids, logits, loss_mask, attention, in_draft, positions = lay_out(documents(cfg, [6, 4]), [[0, 1]])
    positions[0, 3] = 7
    with pytest.raises(UsageError, match="position_ids"):
        ttt_loss(drafter, aux, ids, logits, loss_mask, attention, position_ids=positions)


def test_packed_batches_hold_every_sample_once_within_the_row_length():
    lengths = [int(x) for x in torch.randint(5, 300, (500,), generator=torch.Generator().manual_seed(0))]
    lengths[7] = 700  # longer than a row: a row of its own
    indices = list(range(3, 500))
    batches = packed_batches(indices, lengths, global_rows=4, row_tokens=512, seed=1, epoch=0)
    rows = [row for batch in batches for row in batch]
    assert sorted(i for row in rows for i in row) == indices
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows if row != [7]) and [7] in rows
    assert all(len(b) == 4 for b in batches[:-1]) or sum(len(b) < 4 for b in batches) == 1
    fill = sum(lengths[i] for i in indices) / (len(rows) * 512)
    assert fill > 0.9, f"rows are only {fill:.0%} full"
    assert packed_batches(indices, lengths, 4, 512, seed=1, epoch=0) == batches
    assert packed_batches(indices, lengths, 4, 512, seed=1, epoch=1) != batches


def test_collate_packed_lays_samples_end_to_end(tmp_path):
    from eaglekit.data.tokens import TokenStore, write_token_store

    samples = [(f"s{i}", list(range(10 * i, 10 * i + n)), [0] * 2 + [1] * (n - 2)) for i, n in enumerate([4, 6, 3])]
    write_token_store(tmp_path / "tokens.safetensors", samples)
    store = TokenStore(tmp_path / "tokens.safetensors")
    batch = collate_packed(store, [[0, 1], [2]])
    assert batch.input_ids.shape == (2, 10)
    assert batch.input_ids[0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert batch.position_ids[1].tolist() == list(range(10))  # padding continues the last document
    assert batch.attention_mask[1].tolist() == [1] * 3 + [0] * 7
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    assert collate(store, [0, 1, 2]).position_ids is None


def test_target_keeps_packed_documents_apart():
    """transformers' packed-sequence format: position ids restarting at 0 mask attention per document."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).eval()
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[::2] = True
    target = TargetFeatures(model, [2, 3, 4], t2d)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 97, (7,), generator=g), torch.randint(0, 97, (5,), generator=g)
    packed = target(torch.cat([a, b])[None], position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None])
    for doc, part in ((a, slice(0, 7)), (b, slice(7, 12))):
        alone = target(doc[None])
        torch.testing.assert_close(packed.aux[0, part], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.target_logits[0, part], alone.target_logits[0], rtol=1e-5, atol=1e-5)


def test_train_stage_packs_and_refuses_a_target_that_mixes_documents(tmp_path, tiny_target, monkeypatch):
    from test_extract import prepared_run
    from test_train import metrics, train

    settings = {
        "ttt": {"steps": 2},
        "batch_size": 2,
        "lr": 1e-3,
        "warmup_steps": 1,
        "max_steps": 3,
        "eval_every": 3,
        "save_every": 3,
        "log_every": 1,
        "eval_samples": 4,
        "packing": True,
        "pack_length": 256,
    }
    cfg = prepared_run(tmp_path / "ok", tiny_target, n=48, train=settings)
    row = train(cfg)
    assert row["counts"]["steps"] == 3
    rows = [r for r in metrics(cfg) if r["kind"] == "train"]
    tokens = rows[0]["tokens"]
    assert tokens > 2 * 128, "a packed micro-batch of 2 rows holds several samples"  # tiny samples are ~100 tokens
    # the whole path (packed plan, collate, the target's packed features, TTT) evaluates the untrained drafter
    # on the held-out samples exactly as the unpacked path does
    plain = prepared_run(tmp_path / "plain", tiny_target, n=48, train={**settings, "packing": False})
    train(plain)
    first = [next(r for r in metrics(c) if r["kind"] == "eval") for c in (cfg, plain)]
    assert first[0]["step"] == first[1]["step"] == 0
    assert first[0]["loss_k"] == pytest.approx(first[1]["loss_k"], rel=1e-4)
    assert first[0]["acc_k"] == pytest.approx(first[1]["acc_k"], abs=1e-6)
    ledger = [json.loads(line) for line in (Path(cfg.run_dir) / "ledger.jsonl").read_text().splitlines()]
    checks = {c["name"]: c for e in ledger if e.get("event") == "start" for c in e.get("preflight", [])}
    assert checks["packing"]["status"] == "ok" and "2 rows of up to 256 tokens" in checks["packing"]["detail"]

    # a target whose attention ignores position ids: the first packed batch is refused, before any step
    call = TargetFeatures.__call__
    monkeypatch.setattr(
        TargetFeatures,
        "__call__",
        lambda self, ids, mask=None, with_logits=True, position_ids=None: call(
            self, ids, None if mask is None else torch.ones_like(mask), with_logits
        ),
    )
    bad = prepared_run(tmp_path / "bad", tiny_target, n=24, train=settings)
    with pytest.raises(EaglekitError, match="packed document differ"):
        train(bad)
    assert not (Path(bad.run_dir) / "train" / "checkpoints" / "latest").exists()


def test_packed_rows_are_random_mixtures_not_length_bands():
    """Two kinds of samples, one twice as long as the other: rows mix them (sorting by length first would make
    every row one kind, and every optimizer step see one kind of data)."""
    lengths = [100 if i % 2 else 200 for i in range(400)]
    rows = [row for batch in packed_batches(list(range(400)), lengths, 1, 1000, seed=0, epoch=0) for row in batch]
    mixed = sum(len({lengths[i] for i in row}) == 2 for row in rows)
    assert mixed > 0.8 * len(rows)


def run_batches(tmp_path, lengths, world: int, rank: int, *, packing=True, seed=3, batch_size=2, row_tokens=256):
    """RunBatches over a token store of samples of ``lengths`` (a tenth held out), as the train stage builds it."""
    from types import SimpleNamespace

    from eaglekit.data.tokens import TokenStore, write_token_store
    from eaglekit.training.data import RunBatches

    path = tmp_path / "tokens.safetensors"
    if not path.exists():
        write_token_store(path, [(f"s{i}", [i % 97] * n, [1] * n) for i, n in enumerate(lengths)])
    cfg = SimpleNamespace(
        train=SimpleNamespace(
            packing=packing, seed=seed, batch_size=batch_size, eval_samples=None, pack_length=row_tokens,
            max_steps=None, grad_accum=1,
        ),
        prepare=SimpleNamespace(max_length=row_tokens),
        data=SimpleNamespace(eval_fraction=0.1),
    )  # fmt: skip
    return RunBatches(cfg, TokenStore(path), [list(range(len(lengths)))], None, world, rank)


SKEWED = [int(x) for x in (torch.rand(300, generator=torch.Generator().manual_seed(5)) ** 3 * 250 + 6)]


@pytest.mark.parametrize(("world", "seed"), [(1, 0), (2, 3)])
def test_packed_epochs_count_their_own_rows_and_see_every_sample_once(tmp_path, world, seed):
    """First-fit packing of each epoch's reshuffled order makes its own number of rows; the run walks each epoch's
    real batches (the count of epoch 0 standing for all of them crashed on an epoch with fewer rows and skipped the
    extra rows of one with more), and every training sample is seen exactly once per epoch over all ranks."""
    ranks = [run_batches(tmp_path, SKEWED, world, r, seed=seed) for r in range(world)]
    epochs = 6
    counts = [ranks[0].epoch_count(e) for e in range(epochs)]
    # else this tests nothing: later epochs pack into fewer rows than epoch 0 (the crash) and, with one rank, into
    # more (the rows that were silently skipped)
    assert min(counts) < counts[0] and (world > 1 or max(counts) > counts[0]), counts
    total = ranks[0].micro_batches_for(epochs)
    assert total == sum(counts)
    seen: list[list[int]] = [[] for _ in range(epochs)]
    for u in range(total):
        epoch, pos = ranks[0].position(u)
        for r in ranks:
            assert r.position(u) == (epoch, pos)
            seen[epoch].extend(i for row in r.share(r._batches_of(epoch)[pos]) for i in row)
            batch = r.micro_batch(u, r.store, None)  # what the loader collates: no IndexError at any boundary
            assert batch.input_ids.shape[0] == len(r.share(r._batches_of(epoch)[pos]))
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == sorted(ranks[0].train_idx), f"epoch {epoch}"
    # a run resumed in the middle of a later epoch (a fresh RunBatches, as after a restart) lands on the same rows
    later = total - counts[-1] // 2
    fresh = run_batches(tmp_path, SKEWED, world, 0, seed=seed)
    assert fresh.position(later) == ranks[0].position(later)
    assert fresh.share(fresh._batches_of(fresh.position(later)[0])[fresh.position(later)[1]]) == ranks[0].share(
        ranks[0]._batches_of(ranks[0].position(later)[0])[ranks[0].position(later)[1]]
    )
    assert fresh.epoch_progress(later) == pytest.approx(epochs - 1 + (counts[-1] - counts[-1] // 2) / counts[-1])


def test_unpacked_batches_keep_a_short_last_batch_under_ddp(tmp_path):
    """Without packing, an epoch whose samples do not divide into ranks' batches keeps its last samples (joined to
    the batch before) instead of dropping them."""
    lengths = [20 + i % 13 for i in range(61)]
    ranks = [run_batches(tmp_path, lengths, 2, r, packing=False, batch_size=4) for r in range(2)]
    for epoch in range(3):
        seen = [i for r in ranks for b in r.epoch(epoch) for i in r.share(b)]
        assert sorted(seen) == sorted(ranks[0].train_idx)

"""Training batches: the train / held-out split, length-bucketed batches in a deterministic order, padding.

The order of every epoch is a function of (seed, epoch) alone, and micro-batch ``u`` of the whole run is
batch ``u % per_epoch`` of epoch ``u // per_epoch`` — so a resumed run finds its data position from the
step it restores, with nothing to replay. Under torchrun each global batch holds ``batch_size × world``
samples and rank r takes every world-th of them.

Sequences are right-padded and masked (``attention_mask``); packing several documents into one row is not
supported: the TTT attention would need per-document masks for the draft's own steps too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from eaglekit.data.shards import FeatureStore
from eaglekit.data.split import is_held_out
from eaglekit.data.tokens import TokenStore

BUCKET_BATCHES = 64  # batches per length bucket: sorted inside, shuffled between


def split_indices(store: TokenStore, eval_fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices, decided by each sample's id (the same split in every stage)."""
    train, held = [], []
    for i, sid in enumerate(store.ids):
        (held if is_held_out(sid, eval_fraction) else train).append(i)
    return train, held


def epoch_batches(indices: list[int], lengths: list[int], global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Global batches of one epoch: shuffle, sort by length within buckets, shuffle the batches."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(indices)
    rng.shuffle(order)
    bucket = global_batch * BUCKET_BATCHES
    batches = []
    for start in range(0, len(order), bucket):
        chunk = sorted(order[start:start + bucket], key=lambda i: lengths[i])
        batches.extend(chunk[j:j + global_batch] for j in range(0, len(chunk), global_batch))
    rng.shuffle(batches)
    return batches


def eval_batches(indices: list[int], lengths: list[int], global_batch: int) -> list[list[int]]:
    order = sorted(indices, key=lambda i: (lengths[i], i))
    return [order[j:j + global_batch] for j in range(0, len(order), global_batch)]


def rank_share(batch: list[int], rank: int, world: int) -> list[int]:
    return batch[rank::world]


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor   # [B, L] int64
    loss_mask: torch.Tensor        # [B, L] int64
    aux: torch.Tensor | None = None          # offline: [B, L, 3Ht]
    last_hidden: torch.Tensor | None = None  # offline: [B, L, Ht]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(*(move(t) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.aux, self.last_hidden)))


def pad(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    """Right-pad rows [L_i, ...] into [B, max L, ...]."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def collate(store: TokenStore, indices: list[int], features: FeatureStore | None = None) -> Batch:
    samples = [store[i] for i in indices]
    ids = [s[1] for s in samples]
    batch = Batch(input_ids=pad(ids), attention_mask=pad([torch.ones_like(t) for t in ids]),
                  loss_mask=pad([s[2].long() for s in samples]))
    if features is not None:
        feats = [features[s[0]] for s in samples]
        batch.aux, batch.last_hidden = pad([f[0] for f in feats]), pad([f[1] for f in feats])
    return batch

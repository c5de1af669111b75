"""Training batches: the train / held-out split, length-bucketed batches in a deterministic order, padding.

The order of every epoch is a function of (seed, epoch) alone, and micro-batch ``u`` of the whole run is
batch ``u % per_epoch`` of epoch ``u // per_epoch`` — so a resumed run finds its data position from the
step it restores, with nothing to replay. Under torchrun each global batch holds ``batch_size × world``
samples and rank r takes every world-th of them.

Sequences are right-padded and masked (``attention_mask``). With ``train.packing`` several samples share a
row instead (``packed_batches``, ``collate_packed``): ``position_ids`` restart at 0 where each sample begins,
and that is all the TTT loss and the target need to keep documents apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch

from eaglekit.data.shards import FeatureStore
from eaglekit.data.split import is_held_out
from eaglekit.data.tokens import TokenStore

BUCKET_BATCHES = 64  # batches per length bucket: sorted inside, shuffled between
PACK_WINDOW = 4096  # samples packed together (first-fit in random order): rows close when their window ends


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


def pack_length(cfg) -> int:
    """Tokens per packed row: train.pack_length, else prepare.max_length (the longest a prepared sample can be)."""
    return cfg.train.pack_length or cfg.prepare.max_length


def packed_batches(indices: list[int], lengths: list[int], global_rows: int, row_tokens: int, seed: int,
                   epoch: int) -> list[list[list[int]]]:
    """Global batches of one epoch as rows of samples: each row holds samples whose lengths sum to at most
    ``row_tokens`` (a longer sample has a row to itself); ``global_rows`` rows per batch.

    Shuffle, then first-fit in that order within windows of PACK_WINDOW samples: each sample goes into the first
    row with room, so every row is a random mixture of the data. Sorting by length first (first-fit decreasing)
    packs a little denser but makes each row one length band — on the tiny target, where the task kind sets the
    length, that cost 9 % of τ at K=5 (benchmarks/RESULTS.md, the τ race).
    """
    rng = random.Random(f"{seed}:{epoch}:packed")
    order = list(indices)
    rng.shuffle(order)
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_WINDOW):
        window_rows: list[list[int]] = []
        room: list[int] = []
        for i in order[start:start + PACK_WINDOW]:
            row = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
            if row is None:
                window_rows.append([i])
                room.append(row_tokens - lengths[i])
            else:
                window_rows[row].append(i)
                room[row] -= lengths[i]
        rows.extend(window_rows)
    rng.shuffle(rows)
    batches = [rows[j:j + global_rows] for j in range(0, len(rows), global_rows)]
    return batches


def rank_share(batch: list, rank: int, world: int) -> list:
    return batch[rank::world]


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor   # [B, L] int64
    loss_mask: torch.Tensor        # [B, L] int64
    aux: torch.Tensor | None = None          # offline: [B, L, 3Ht]
    last_hidden: torch.Tensor | None = None  # offline: [B, L, Ht]
    position_ids: torch.Tensor | None = None  # packed rows: [B, L], 0 where each sample starts

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


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


def collate_packed(store: TokenStore, rows: list[list[int]], features: FeatureStore | None = None) -> Batch:
    """Rows of samples laid end to end, right-padded; ``position_ids`` count 0.. within each sample (and on into
    the padding, which nothing attends)."""
    samples = [[store[i] for i in row] for row in rows]
    joined = lambda parts: torch.cat(parts) if len(parts) > 1 else parts[0]  # noqa: E731
    ids = [joined([s[1] for s in row]) for row in samples]
    positions = [joined([torch.arange(len(s[1])) for s in row]) for row in samples]
    width = max(len(r) for r in ids)
    batch = Batch(input_ids=pad(ids), attention_mask=pad([torch.ones_like(t) for t in ids]),
                  loss_mask=pad([joined([s[2].long() for s in row]) for row in samples]),
                  position_ids=torch.stack([torch.cat([p, p[-1] + 1 + torch.arange(width - len(p))]) for p in positions]))
    if features is not None:
        feats = [[features[s[0]] for s in row] for row in samples]
        batch.aux = pad([joined([f[0] for f in row]) for row in feats])
        batch.last_hidden = pad([joined([f[1] for f in row]) for row in feats])
    return batch

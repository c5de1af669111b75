"""Training batches: the train / held-out split, length-bucketed batches in a deterministic order, padding.

The order of every epoch is a function of (seed, epoch) and the data's blocks alone, and micro-batch ``u``
of the whole run is found by counting each epoch's own batches (``RunBatches.position``): packing a reshuffled
order gives each epoch its own number of rows, so no epoch's count stands for another's. A resumed run finds its
data position from the step it restores, with nothing to replay. Under torchrun each global batch holds
``batch_size × world`` samples (or rows) and rank r takes every world-th of them; an epoch's last batch, when it
is too short to give every rank one, joins the batch before it, so every sample is seen once per epoch.

Blocks are the feature shards (offline) or the same plan of the token store (online, so both modes see
one order): an epoch visits the blocks in a shuffled order, each block's samples shuffled, and shuffles
within windows of ``BUCKET_BATCHES`` batches — so offline training reads a few memory-mapped shards at a
time instead of every shard at random. ``Loader`` collates the next micro-batches in a background thread.

Sequences are right-padded and masked (``attention_mask``). With ``train.packing`` several samples share a
row instead (``packed_batches``, ``collate_packed``): ``position_ids`` restart at 0 where each sample begins,
and that is all the TTT loss and the target need to keep documents apart.
"""

from __future__ import annotations

import copy
import math
import queue
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch

from eaglekit.data.shards import FeatureStore, Rows
from eaglekit.data.split import is_held_out
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError

BUCKET_BATCHES = 64  # batches per length bucket: sorted inside, shuffled between
PACK_WINDOW = 4096  # samples packed together (first-fit in random order): rows close when their window ends
FeatureRows = FeatureStore | Mapping[str, Rows]  # stored features by sample id: shards, or those a stream fetched


def split_indices(store: TokenStore, eval_fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices, decided by each sample's id (the same split in every stage)."""
    train: list[int] = []
    held: list[int] = []
    for i, sid in enumerate(store.ids):
        (held if is_held_out(sid, eval_fraction) else train).append(i)
    return train, held


def block_order(indices: list[int], blocks: list[list[int]] | None, rng: random.Random) -> list[int]:
    """The samples in a shuffled order that reads one block (feature shard) after another: blocks shuffled, then
    the samples inside each. ``blocks=None``: one block."""
    wanted = set(indices)
    groups = [list(indices)] if blocks is None else [[i for i in b if i in wanted] for b in blocks]
    if blocks is not None:
        covered = {i for g in groups for i in g}
        groups.append(sorted(wanted - covered))  # samples no block holds (none, when blocks are the shards)
    rng.shuffle(groups)
    order = []
    for group in groups:
        rng.shuffle(group)
        order.extend(group)
    return order


def epoch_batches(
    indices: list[int],
    lengths: list[int],
    global_batch: int,
    seed: int,
    epoch: int,
    blocks: list[list[int]] | None = None,
) -> list[list[int]]:
    """Global batches of one epoch: blocks in a shuffled order, each shuffled; then windows of BUCKET_BATCHES
    batches, sorted by length inside (little padding) and their batches shuffled. ``blocks=None``: one block."""
    rng = random.Random(f"{seed}:{epoch}")
    order = block_order(indices, blocks, rng)
    bucket = global_batch * BUCKET_BATCHES
    batches = []
    for start in range(0, len(order), bucket):
        chunk = sorted(order[start : start + bucket], key=lambda i: lengths[i])
        window = [chunk[j : j + global_batch] for j in range(0, len(chunk), global_batch)]
        rng.shuffle(window)
        batches.extend(window)
    return batches


def eval_batches(indices: list[int], lengths: list[int], global_batch: int) -> list[list[int]]:
    order = sorted(indices, key=lambda i: (lengths[i], i))
    return [order[j : j + global_batch] for j in range(0, len(order), global_batch)]


def pack_length(cfg) -> int:
    """Tokens per packed row: train.pack_length, else prepare.max_length (the longest a prepared sample can be)."""
    return cfg.train.pack_length or cfg.prepare.max_length


def packed_batches(
    indices: list[int],
    lengths: list[int],
    global_rows: int,
    row_tokens: int,
    seed: int,
    epoch: int,
    blocks: list[list[int]] | None = None,
) -> list[list[list[int]]]:
    """Global batches of one epoch as rows of samples: each row holds samples whose lengths sum to at most
    ``row_tokens`` (a longer sample has a row to itself); ``global_rows`` rows per batch.

    Shuffle (feature shard by shard, as epoch_batches), then first-fit in that order within windows of PACK_WINDOW samples: each sample goes into the first
    row with room, so every row is a random mixture of the data. Sorting by length first (first-fit decreasing)
    packs a little denser but makes each row one length band — on the tiny target, where the task kind sets the
    length, that cost 9 % of τ at K=5 (the τ race of 2026-12-03, commit 3c35289).
    """
    rng = random.Random(f"{seed}:{epoch}:packed")
    order = block_order(indices, blocks, rng)
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_WINDOW):
        window_rows: list[list[int]] = []
        room: list[int] = []
        for i in order[start : start + PACK_WINDOW]:
            row = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
            if row is None:
                window_rows.append([i])
                room.append(row_tokens - lengths[i])
            else:
                window_rows[row].append(i)
                room[row] -= lengths[i]
        rows.extend(window_rows)
    rng.shuffle(rows)
    batches = [rows[j : j + global_rows] for j in range(0, len(rows), global_rows)]
    return batches


def keep_every_sample(batches: list[list], world: int) -> list[list]:
    """The epoch's batches, each one too short to give every one of ``world`` ranks an entry joined to a neighbour
    (dropping it would leave its samples out of the epoch); an epoch with fewer entries than ranks makes no batch."""
    kept: list[list] = []
    for batch in batches:
        if kept and (len(batch) < world or len(kept[-1]) < world):
            kept[-1] = kept[-1] + batch
        else:
            kept.append(batch)
    return [b for b in kept if len(b) >= world]


def rank_share(batch: list, rank: int, world: int) -> list:
    return batch[rank::world]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] int64
    aux: torch.Tensor | None = None  # offline: [B, L, 3Ht] in the storage dtype
    last_hidden: torch.Tensor | None = None  # offline: [B, L, Ht]
    scale_exp: torch.Tensor | None = None  # offline fp8: [B, L, 4] int8 (see eaglekit.data.shards)
    position_ids: torch.Tensor | None = None  # packed rows: [B, L], 0 where each sample starts

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.attention_mask.to(device, non_blocking=True),
            self.loss_mask.to(device, non_blocking=True),
            *(move(getattr(self, f.name)) for f in fields(self)[3:]),
        )


def pad(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    """Right-pad rows [L_i, ...] into [B, max L, ...]."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def collate_packed(store: TokenStore, rows: list[list[int]], features: FeatureRows | None = None) -> Batch:
    """Rows of samples laid end to end, right-padded; ``position_ids`` count 0.. within each sample (and on into
    the padding, which nothing attends)."""
    samples = [[store[i] for i in row] for row in rows]
    joined = lambda parts: torch.cat(parts) if len(parts) > 1 else parts[0]  # noqa: E731
    ids = [joined([s[1] for s in row]) for row in samples]
    positions = [joined([torch.arange(len(s[1])) for s in row]) for row in samples]
    width = max(len(r) for r in ids)
    batch = Batch(
        input_ids=pad(ids),
        attention_mask=pad([torch.ones_like(t) for t in ids]),
        loss_mask=pad([joined([s[2].long() for s in row]) for row in samples]),
        position_ids=torch.stack([torch.cat([p, p[-1] + 1 + torch.arange(width - len(p))]) for p in positions]),
    )
    if features is not None:
        feats = [[features[s[0]] for s in row] for row in samples]
        batch.aux = pad([joined([f.aux for f in row]) for row in feats])
        batch.last_hidden = pad([joined([f.last_hidden for f in row]) for row in feats])
        if feats[0][0].scale_exp is not None:
            batch.scale_exp = pad([joined([f.scale_exp for f in row]) for row in feats])
    return batch


def collate(store: TokenStore, indices: list[int], features: FeatureRows | None = None) -> Batch:
    """One sample per row, right-padded; no position ids (each row is one document)."""
    batch = collate_packed(store, [[i] for i in indices], features)
    batch.position_ids = None
    return batch


class Loader:
    """Micro-batch ``u`` of the run, collated ahead of time in a background thread.

    ``make(u, store, features)`` collates micro-batch u with the stores it is given: the thread works on its
    own copies of the token and feature stores (their open files are not shared between threads). Asking
    for any u other than the next one restarts the read-ahead there.
    """

    def __init__(self, make: Callable, store: TokenStore, features: FeatureStore | None, ahead: int = 2):
        self.make, self.ahead = make, ahead
        self.store, self.features = copy.copy(store), copy.copy(features)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next: int | None = None

    def get(self, u: int) -> Batch:
        if self._queue is None or u != self._next:
            self._queue = self._start(u)
        item = self._queue.get()
        self._next = u + 1
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def _start(self, u: int) -> queue.Queue:
        """Restart the read-ahead at micro-batch u; returns the queue it fills."""
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.ahead)
        self._thread = threading.Thread(
            target=self._run, args=(u, self._queue, self._stop), daemon=True, name="eaglekit-loader"
        )
        self._thread.start()
        return self._queue

    def _run(self, u: int, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = self.make(u, self.store, self.features)
            except BaseException as err:  # raised in the training thread by get()
                item = err
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            u += 1

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread = self._queue = None


class RunBatches:
    """The whole run's data order: micro-batch ``u`` is batch ``u % per_epoch`` of epoch ``u // per_epoch``, and this
    rank's share of it. Plain batches of samples, or (``train.packing``) rows of packed samples."""

    def __init__(
        self,
        cfg,
        store: TokenStore,
        blocks: list[list[int]],
        feature_store: FeatureRows | None,
        world: int,
        rank: int,
    ):
        tc = cfg.train
        self.store, self.feature_store, self.world, self.rank = store, feature_store, world, rank
        self.packing, self.seed, self.blocks = tc.packing, tc.seed, blocks
        self.lengths = store.lengths.tolist()
        self.train_idx, held_idx = split_indices(store, cfg.data.eval_fraction)
        if not self.train_idx:
            raise EaglekitError(
                f"no training samples: all {len(store)} are held out (data.eval_fraction {cfg.data.eval_fraction})",
                "lower data.eval_fraction or add data",
            )
        self.global_batch = tc.batch_size * world
        self.row_tokens = pack_length(cfg) if tc.packing else 0
        self._epoch_cache: dict[int, list[list]] = {}
        self._counts: list[int] = []  # batches in epoch 0, 1, ... as far as asked
        self._count_lock = threading.Lock()
        self.per_epoch = self.epoch_count(0)  # epoch 0's: what the run line reports; later epochs may differ (packing)
        if self.per_epoch == 0:
            raise EaglekitError(
                f"{len(self.train_idx)} training samples make no batch for {world} processes",
                "add data or use fewer processes",
            )
        if tc.eval_samples and len(held_idx) > tc.eval_samples:
            held_idx = sorted(random.Random(tc.seed).sample(held_idx, tc.eval_samples))
        self.held_idx = held_idx

    def epoch(self, epoch: int) -> list[list]:
        """Each global batch: sample indices, or (packing) rows of sample indices; at least one entry per rank."""
        if self.packing:
            batches: list[list] = packed_batches(
                self.train_idx, self.lengths, self.global_batch, self.row_tokens, self.seed, epoch, self.blocks
            )
        else:
            batches = epoch_batches(self.train_idx, self.lengths, self.global_batch, self.seed, epoch, self.blocks)
        return keep_every_sample(batches, self.world)

    def epoch_count(self, epoch: int) -> int:
        """Global batches in ``epoch`` (packed epochs differ: first-fit of another order makes other rows)."""
        with self._count_lock:  # the loader's thread and the loop's both ask
            while len(self._counts) <= epoch:
                self._counts.append(len(self.epoch(len(self._counts))))
            return self._counts[epoch]

    def position(self, u: int) -> tuple[int, int]:
        """(epoch, batch within it) of micro-batch ``u`` of the run, counting each epoch's own batches."""
        epoch = 0
        while u >= self.epoch_count(epoch):
            if self.epoch_count(epoch) == 0:
                raise EaglekitError(
                    f"epoch {epoch} of the training data makes no batch for {self.world} processes (packing gave "
                    "fewer rows than processes)",
                    "add data, use fewer processes, or shorter rows (train.pack_length)",
                )
            u -= self.epoch_count(epoch)
            epoch += 1
        return epoch, u

    def epoch_progress(self, u: int) -> float:
        """Epochs done after ``u`` micro-batches, e.g. 2.25: a quarter into the third."""
        epoch, pos = self.position(u)
        return epoch + pos / self.epoch_count(epoch)

    def micro_batches_for(self, epochs: float) -> int:
        """Micro-batches in the first ``epochs`` epochs (a fraction takes that share of the last one)."""
        whole = int(epochs)
        return sum(self.epoch_count(e) for e in range(whole)) + round((epochs - whole) * self.epoch_count(whole))

    def _batches_of(self, epoch: int) -> list[list]:
        if epoch not in self._epoch_cache:
            self._epoch_cache = {epoch: self.epoch(epoch)}  # one epoch kept: the one being read
        return self._epoch_cache[epoch]

    def held_out(self) -> list[list]:
        """The held-out batches, in one fixed order (every evaluation sees the same rows)."""
        if self.packing:
            batches: list[list] = packed_batches(self.held_idx, self.lengths, self.global_batch, self.row_tokens, 0, 0)
        else:
            batches = eval_batches(self.held_idx, self.lengths, self.global_batch)
        return [b for b in batches if len(b) >= self.world]

    def total_steps(self, tc) -> int:
        return tc.max_steps or max(1, math.ceil(self.micro_batches_for(tc.epochs) / tc.grad_accum))

    def collate(self, entries: list, tokens: TokenStore | None = None, features: FeatureRows | None = None) -> Batch:
        """This rank's entries as a batch, read from ``tokens``/``features`` (the loader thread passes its copies)."""
        if tokens is None:
            tokens, features = self.store, self.feature_store
        return (collate_packed if self.packing else collate)(tokens, entries, features)

    def share(self, entries: list) -> list:
        return rank_share(entries, self.rank, self.world)

    def entries(self, u: int) -> list:
        """This rank's entries of micro-batch u of the run: sample indices, or (packing) rows of them."""
        epoch, pos = self.position(u)
        return self.share(self._batches_of(epoch)[pos])

    def micro_batch(self, u: int, tokens: TokenStore, features: FeatureStore | None) -> Batch:
        """Micro-batch u of the run for this rank (called by the Loader's read-ahead thread)."""
        return self.collate(self.entries(u), tokens, features)

"""What every family's step-memory model shares (EAGLE-3's in ``drafters/eagle3/memory.py``, the block drafters' in
``drafters/dflash/memory.py``): the figures of one step on one GPU (``StepMemory``), the counter of the storages a
step keeps for backward (``Storages``), the bytes of the weights with their optimizer state, and the fewest
context-parallel ranks at which a step fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ADAMW_BYTES = 16  # fp32 master weight, its gradient and AdamW's two moments
MASTER_BYTES = 4  # a frozen weight, fp32
COMPUTE_BYTES = 2  # autocast's bf16 copy of a weight


@dataclass
class StepMemory:
    """Bytes of one training step on one GPU, by part."""

    weights: int  # trainable parameters with gradients and optimizer state, frozen parameters
    batch: int  # the row's aux features, its target logits and their softmax
    activations: int  # what the TTT steps keep for backward
    transient: int  # the larger phase's temporaries: the head loss's (forward) or a recomputed step's (backward)
    per_token: float  # kept activation bytes per token of the row (all TTT steps)
    gathered: int = (
        0  # context parallel: the other ranks' step-0 keys and values, kept (and copied) for the draft steps
    )
    context_parallel: int = 1  # ranks splitting each row: the figures above are one rank's

    @property
    def total(self) -> int:
        return self.weights + self.batch + self.activations + self.gathered + self.transient


class Made(NamedTuple):
    """A storage ``Storages`` saw made: a weak reference (it tells when the storage is freed), its bytes, and the
    phase it was made in."""

    storage: StorageWeakRef
    nbytes: int
    phase: str


class Storages(TorchDispatchMode):
    """The storages the ops run under it make, each filed under the ``phase`` set when it was made, and (``peak``)
    the most bytes of them alive at once. Both step-memory models count what a step keeps with it (this module's
    and ``block_memory.py``'s): the storages the step made that are still alive when it returns, whoever holds
    them (autograd's saved tensors, a checkpointed step's closure, the step's outputs). A storage counts once, by
    its bytes, however many views of it there are; what existed before (parameters, inputs) and views of it do not
    count. Saved-tensor hooks see only what autograd saves (7 % less on a checkpointed TTT step), and count what
    a graph dropped before the step returns saved (a detached figure's)."""

    def __init__(self, peak: bool = False) -> None:
        super().__init__()
        self.made: dict[int, Made] = {}  # by the storage's address
        self.before: dict[int, StorageWeakRef] = {}  # what existed before (parameters, inputs), by address
        self.track_peak = peak
        self.peak = 0
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):  # what existed before (parameters, inputs): a view of it is not new
            if isinstance(t, torch.Tensor) and self._made(t) is None:
                self.before[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and not self._before(t):
                storage = t.untyped_storage()
                if self._made(t) is None:  # new (an address freed and reused is a new storage)
                    self.made[storage.data_ptr()] = Made(StorageWeakRef(storage), storage.nbytes(), self.phase)
        if self.track_peak:
            self.peak = max(self.peak, self.alive())
        return out

    def _made(self, t: torch.Tensor) -> Made | None:
        made = self.made.get(t.untyped_storage().data_ptr())
        return made if made is not None and not made.storage.expired() else None

    def _before(self, t: torch.Tensor) -> bool:
        before = self.before.get(t.untyped_storage().data_ptr())
        return before is not None and not before.expired()

    def alive_sizes(self, phase: str | None = None) -> list[int]:
        """The bytes of each storage made that is alive now: all of them, or those made in ``phase``."""
        self.made = {k: v for k, v in self.made.items() if not v.storage.expired()}
        return [made.nbytes for made in self.made.values() if phase is None or made.phase == phase]

    def alive(self, phase: str | None = None) -> int:
        """Bytes of the storages made that are alive now: all of them, or those made in ``phase``."""
        return sum(self.alive_sizes(phase))


def weight_bytes(trainable: int, frozen: int, *, bf16: bool, looked_up: int = 0) -> int:
    """Bytes of a drafter's parameters in a step: ``trainable`` ones as an fp32 master weight, its gradient and
    AdamW's two moments, ``frozen`` ones in fp32, and with ``bf16`` (autocast) the bf16 copy autocast keeps for the
    step of every weight it casts: all but the ``looked_up`` frozen ones (an embedding table: a lookup is not cast)."""
    cast = trainable + frozen - looked_up
    return ADAMW_BYTES * trainable + MASTER_BYTES * frozen + (COMPUTE_BYTES * cast if bf16 else 0)


def ranks_to_fit(fits: Callable[[StepMemory], bool], memory: Callable[[int], StepMemory], most: int = 64) -> int | None:
    """The fewest ranks per row (powers of two up to ``most``) at which ``memory(ranks)`` ``fits``; None if none."""
    ranks = 2
    while ranks <= most:
        if fits(memory(ranks)):
            return ranks
        ranks *= 2
    return None

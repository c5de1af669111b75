"""Context parallelism (train.context_parallel) for EAGLE-3's TTT step and the block drafters' objective: the ranks
of a group split each row's positions, so a row longer than one GPU's memory trains across several.

How, and why this way. Rank r of a group of P holds positions [start, end) of every row of the micro-batch (a
contiguous piece of ceil(L / P)), with the row's heavy per-position inputs — the aux features, the target's logits
and in-draft flags — only for those positions plus a halo of ``steps`` to the right (a chain at t is trained on
the targets at t+1..t+steps, so its targets may lie on the next rank). The O(L) integer metadata (token ids, masks,
position ids) stays whole on every rank: the step reads token t+1+k and document starts across the boundary, and
it costs bytes per token, where the features cost kilobytes.

Every rank runs step 0 on its own positions, then all-gathers the step-0 keys and values of the whole row through
``torch.distributed.nn.functional.all_gather`` (autograd-aware: its backward sends each rank the summed gradient of
its own keys and values), and attends its queries over them with the global key indices the reference already
uses (document start, window, causality: ``_Positions.first_key``). The draft steps >= 1 need nothing more: a
chain's own keys of steps 1..k are made where the chain lives, and its step-0 keys are the gathered ones. This is
Llama 3's all-gather context parallelism ("pass-KV"), chosen over the alternatives for the TTT step:
  - one collective per training step: the draft steps reuse step 0's keys, where Ulysses' all-to-all over heads
    would run twice per attention call (step 0 and each draft step, on the ragged sets of chains still counting);
  - no limit from the head count: Ulysses splits heads, so P must divide the KV heads (a GQA drafter has few);
  - the masks stay one definition: packed documents, the sliding window and the TTT chain keys are spans of global
    key indices, the same kernel (flex on CUDA, the reference elsewhere) runs them; ring attention would cut every
    span per hop and merge partial softmaxes;
  - the cost is the whole row's step-0 keys and values on every rank (2 x nKV x head_dim per token, a few percent
    of a token's activations for a GQA drafter; ``training/memory.py`` counts them), and causal work is uneven
    (the last rank's queries see the most keys) — the memory, not the time, is what CP is for here.

The loss is the single-process loss: each rank sums its own chains' losses and divides by the count over every
rank (the normaliser ``training/objective.py`` already passes under torchrun; without one, the group's count), and
``sequence`` normalisation sums each document's counts over the group first. With data parallelism too (world =
DP x CP), ranks r*P .. r*P+P-1 form context group r, the data order is split over the DP groups, and DDP/FSDP over
the whole world average gradients exactly as without CP (the all-gather's backward has already summed what each
rank's keys owe the others).

The block drafters (DFlash, DSpark: ``training/block.py``) split the same way, with the same collective. A DFlash
layer's context keys and values are projections of the target's features at each context position, independent of
the drafter's earlier layers, so each rank projects every layer's keys and values at its own positions and one
all-gather gives every rank the whole row's (all layers at once). Anchors are drawn over the whole row, as one
process draws them, and broadcast from the group's first rank (so the ranks agree even where their random streams
would not); each rank runs the blocks whose anchors it owns over the gathered context (document, window and the
block's own queries as one process masks them). A block of anchor a reads the target's argmax at most
block_size - 1 positions past a, so the halo of the heavy inputs is the block size. The loss is each rank's blocks' sum over the group's count
of counted slots, times the group's size for DDP's average (each data-parallel group then weighs as one process
without context parallelism: the block objective normalises per data-parallel rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from eaglekit.training.data import Batch


@dataclass(frozen=True)
class ContextGroup:
    """The ranks that split each row: this rank's index in the group, the group's size and its process group."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int

    def shard(self, length: int, halo: int) -> ContextShard:
        """This rank's share of rows of ``length`` positions, whose targets reach ``halo`` positions past its own
        (a TTT's steps, a block's size)."""
        piece = math.ceil(length / self.size) if length else 0
        start = min(self.rank * piece, length)
        end = min(start + piece, length)
        return ContextShard(self, length, piece, start, end, min(end + halo, length) if end > start else end)

    def cut(self, batch: Batch, halo: int) -> Batch:
        """``batch`` with its stored features cut to this rank's positions and halo (the metadata stays whole), so
        that only this rank's share of the row is decoded, run through the target's head and moved to the GPU."""
        shard = self.shard(batch.input_ids.shape[1], halo)

        def piece(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, shard.start : shard.stop]

        return replace(
            batch, aux=piece(batch.aux), last_hidden=piece(batch.last_hidden), scale_exp=piece(batch.scale_exp)
        )

    def own_tokens(self, batch: Batch) -> int:
        """The real tokens among this rank's positions of the batch's rows."""
        shard = self.shard(batch.input_ids.shape[1], 0)
        return int(batch.attention_mask[:, shard.start : shard.end].sum())


@dataclass(frozen=True)
class ContextShard:
    """Positions [start, end) of every row are this rank's chains; [start, stop) the rows of its heavy inputs (its
    positions and the halo of targets its chains reach on the next rank)."""

    context: ContextGroup
    length: int  # the row's positions, L
    piece: int  # positions per rank, ceil(L / P): the last rank's piece may be shorter, or empty
    start: int
    end: int
    stop: int

    def own_rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """Flat indices b * L + t of this rank's positions, sorted (the order its step-0 outputs come in)."""
        rows = torch.arange(self.start, self.end, device=device)
        return (torch.arange(batch, device=device)[:, None] * self.length + rows).reshape(-1)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [B, stop - start, ...] input."""
        return t[:, : self.end - self.start]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, end - start, ...] of this rank -> [B, L, ...] of the whole group, with gradients flowing back to the
        rank that made each piece. Pieces are padded to ``piece`` (the collective wants equal shapes) and cut after."""
        short = self.piece - x.shape[1]
        if short:
            x = torch.cat([x, x.new_zeros(x.shape[0], short, *x.shape[2:])], dim=1)
        return _GatherPositions.apply(x, self.context)[:, : self.length]

    def same(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the group's first rank holds it, in place (a choice every rank must make alike: no gradient)."""
        dist.broadcast(t, src=dist.get_global_rank(self.context.group, 0), group=self.context.group)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the group, in place (counts: no gradient)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.context.group)
        return t

    def inputs(self, full: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's rows [start, stop) of a whole-row input [B, L, ...] (tests, and callers holding the whole row)."""
        return None if full is None else full[:, self.start : self.stop]


class _GatherPositions(torch.autograd.Function):
    """All-gather along the positions (dim 1) with its adjoint as backward: each rank gets the sum over the group of
    the gradients of its own piece — a reduce-scatter on NCCL, an all-reduce and a cut elsewhere (gloo has no
    reduce-scatter). torch.distributed.nn.functional.all_gather does the same but is deprecated, and its gloo
    backward names group ranks as global ones (it fails in any group but the first: data x context parallel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, context: ContextGroup) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(context.size)]
        dist.all_gather(parts, x, group=context.group)
        ctx.context = context
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        context: ContextGroup = ctx.context
        pieces = [p.contiguous() for p in grad.chunk(context.size, dim=1)]
        if dist.get_backend(context.group) == dist.Backend.NCCL:
            mine = torch.empty_like(pieces[context.rank])
            dist.reduce_scatter(mine, pieces, op=dist.ReduceOp.SUM, group=context.group)
            return mine, None
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=context.group)
        return summed.chunk(context.size, dim=1)[context.rank].contiguous(), None

"""DFlash's training objective: anchored blocks, cross-entropy against the target's argmax, D-PACE position weights.

As speculators 0.9.0 ships it (``models/dflash/core.py``, ``attention.py``, ``utils.py``, ``losses/utils.py``):

- anchors: up to ``max_anchors`` positions per row, drawn at random among the loss-masked tokens and sorted. The
  block of anchor a holds the anchor token at position a (the bonus token at serving time) and mask tokens at
  a+1 .. a+B-1.
- attention: a block sees the context (the target's states) of its own document strictly before a, and all of its
  own block (non-causal); no other block. This is what vLLM's proposer builds when it drafts after token a. With
  ``sliding_window`` W the drafter narrows it to the keys at most W-1 positions before each query, causally
  (``model/dflash.py``: how vLLM and SGLang serve a sliding DFlash layer).
- labels: slot k of the block is trained to the target's argmax at position a+k-1 (its prediction of token a+k);
  the anchor slot is not trained. A slot past its document's end or outside the loss mask does not count (the
  peer lets a block run into the next packed document; here it stops at the document's end).
- loss: per-slot cross-entropy, weighted by D-PACE (default): with q_k = exp(-CE_k) and s_k = (1-α) q_k + α, slot k
  weighs Σ_{m≥k} Π_{i≤m} s_i — the expected number of accepted tokens that depend on slot k. The alternative
  ``exp-decay`` weighs slot k by exp(-(k-1)/γ) (DFlash's original). The sum is divided by the number of slots.

Metrics: accuracy per block slot, and the block τ measured in training (1 + the run of correct slots from slot 1,
per anchor) — which can differ from serving's (SpecForge#835): ``evaluate`` decodes for the figure that counts.

DSpark (``model/dspark.py``, speculators' ``models/dspark/core.py`` and ``metrics.py``) trains the same blocks with
anchor sampling: slot k is trained to the target's argmax at a+k (its prediction of token a+k+1), the anchor slot
included, and its logits carry the Markov bias of the token at a+k (teacher-forced: the sequence's own token, the
one the label is conditioned on). Its exp-decay weighs slot k by exp(-k/γ); its τ counts the run from slot 0.
speculators adds a confidence-head loss, which eaglekit does not train (``model/dspark.py``).

Context parallelism (train.context_parallel, ``training/context_parallel.py``): each rank of a group holds the
features of its positions of every row (and the target's argmax a block's size past them), projects its positions'
context keys and values, all-gathers them, and runs the blocks whose anchors it owns; the anchors are drawn over the
whole row as one process draws them. Every block is computed as one process computes it, so the ranks' losses and
gradients add up to the single process's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.drafters.dflash.model import DFlashDrafter
from eaglekit.training.context_parallel import ContextGroup, ContextShard
from eaglekit.training.figures import StepFigures

WEIGHTINGS = ("dpace", "exp-decay")
DEFAULT_ANCHORS = 512  # speculators 0.9.0's max_anchors


@dataclass
class BlockOutput:
    loss: torch.Tensor  # scalar, with grad
    correct: torch.Tensor  # [B_size] slots whose argmax equals the label (DFlash's slot 0, the anchor, stays 0)
    counted: torch.Tensor  # [B_size] slots that count
    accepted_run: torch.Tensor  # scalar: Σ over valid anchors of the run of correct slots from the first drafting one
    anchors: torch.Tensor  # scalar: valid anchors
    slot_loss: torch.Tensor  # [B_size] mean cross-entropy per slot over the slots that count (unweighted)

    @property
    def block_tau(self) -> float:
        return 1.0 + float(self.accepted_run) / max(1, int(self.anchors))


def select_anchors(
    loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] -> anchors [B, A] (sorted positions) and valid [B, A]; A = min(max_anchors, most candidates in a row)."""
    rows = []
    for row in loss_mask.bool().cpu():
        candidates = row.nonzero().flatten()
        order = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        rows.append(candidates[order].sort().values)
    width = max(1, max(r.numel() for r in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchors[b, : r.numel()], valid[b, : r.numel()] = r, True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def own_anchors(anchors: torch.Tensor, valid: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid anchors in positions [start, end), in order: anchors and valid [B, A'], A' the most of a row (>= 1)."""
    mine = valid & (anchors >= start) & (anchors < end)
    width = max(1, int(mine.sum(1).max()))
    rows = torch.zeros(anchors.shape[0], width, dtype=anchors.dtype, device=anchors.device)
    kept = torch.zeros(anchors.shape[0], width, dtype=torch.bool, device=anchors.device)
    for b in range(anchors.shape[0]):
        picked = anchors[b][mine[b]]
        rows[b, : picked.numel()], kept[b, : picked.numel()] = picked, True
    return rows, kept


def document_ids(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, L]: which document each position belongs to (packed rows restart position_ids at 0); padding is -1."""
    docs = torch.zeros_like(attention_mask) if position_ids is None else (position_ids == 0).long().cumsum(-1) - 1
    return torch.where(attention_mask.bool(), docs, torch.full_like(docs, -1))


def block_attention_mask(docs: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A*bs, L + A*bs] bool: block j sees its document before anchors[j], and its own block (non-causal)."""
    b, length = docs.shape
    n_q = anchors.shape[1] * block_size
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    q_doc = docs.gather(1, q_anchor)
    kv_pos = torch.arange(length, device=docs.device)
    context = (docs[:, None, :] == q_doc[:, :, None]) & (q_doc[:, :, None] >= 0) & (kv_pos < q_anchor[:, :, None])
    block = torch.arange(n_q, device=docs.device) // block_size
    own = (block[:, None] == block[None, :]).expand(b, n_q, n_q)
    return torch.cat([context, own], dim=-1)


def position_weights(
    ce: torch.Tensor, counted: torch.Tensor, weighting: str, dpace_alpha: float, gamma: float, first_slot: int = 1
) -> torch.Tensor:
    """[N, bs] per-slot weights (no grad). ``counted`` [N, bs] bool; ``first_slot``: the first slot that drafts
    (1 for DFlash, 0 for DSpark), where exp-decay starts at weight 1."""
    with torch.no_grad():
        if weighting == "dpace":
            smooth = (1.0 - dpace_alpha) * torch.exp(-ce.float()) + dpace_alpha
            smooth = torch.where(counted, smooth, torch.ones_like(smooth))
            prefix = torch.cumprod(smooth, dim=-1) * counted
            return prefix.flip(-1).cumsum(-1).flip(-1) * counted
        if weighting == "exp-decay":
            slot = torch.arange(ce.shape[-1], device=ce.device, dtype=torch.float32)
            return torch.exp(-(slot - first_slot).clamp_min(0) / gamma).expand_as(ce) * counted
    raise ValueError(f"unknown position weighting {weighting!r} (one of {WEIGHTINGS})")


def block_loss(
    drafter: DFlashDrafter,
    aux: torch.Tensor,
    target_argmax: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    max_anchors: int = DEFAULT_ANCHORS,
    weighting: str = "dpace",
    dpace_alpha: float = 0.5,
    gamma: float = 4.0,
    generator: torch.Generator | None = None,
    context: ContextGroup | None = None,
    extra_weight: float = 1.0,
) -> BlockOutput:
    """The DFlash (or DSpark) loss of one batch (module docstring). aux [B, L, n*Ht]; target_argmax [B, L]: the
    target's argmax over its whole vocabulary at each position (its next token); the rest [B, L]; ``position_ids``
    for packed rows.

    With ``context`` (context parallelism) aux and target_argmax hold this rank's rows [start, stop) of its shard
    (``ContextGroup.shard(L, block_size)``); the loss is this rank's blocks' share of the group's, and the figures
    are its own blocks' (they add up over the group)."""
    bs = drafter.config.block_size
    first = drafter.first_drafting_slot
    device = drafter.fc.weight.device
    aux, target_argmax = aux.to(device), target_argmax.to(device)
    input_ids, loss_mask, attention_mask = input_ids.to(device), loss_mask.to(device), attention_mask.to(device)
    b, length = input_ids.shape
    positions = (
        torch.arange(length, device=device).expand(b, length) if position_ids is None else position_ids.to(device)
    )
    docs = document_ids(attention_mask, None if position_ids is None else positions)
    anchors, valid = select_anchors(loss_mask * attention_mask, max_anchors, generator)
    shard = None if context is None else context.shard(length, bs)
    if shard is not None:
        anchors, valid = own_anchors(shard.same(anchors), valid, shard.start, shard.end)
    n_anchors = anchors.shape[1]

    slot = torch.arange(bs, device=device)
    index = anchors[:, :, None] + slot + (1 - first)  # [B, A, bs]: the position of the token each slot predicts
    inside = index < length
    index = index.clamp_max(length - 1)
    flat = index.flatten(1)
    same_doc = docs.gather(1, flat).view_as(index) == docs.gather(1, anchors)[:, :, None]
    counted = valid[:, :, None] & inside & same_doc & loss_mask.bool().gather(1, flat).view_as(index) & (slot >= first)

    labels = slot_labels(target_argmax, (index - 1).clamp_min(0), shard)  # t-1 predicts t

    query_ids = torch.full_like(index, drafter.config.mask_token_id)
    query_ids[:, :, 0] = input_ids.gather(1, anchors)
    query_positions = positions.gather(1, anchors)[:, :, None] + slot
    kv = context_kv(drafter, aux, positions, shard)
    mask = block_attention_mask(docs, anchors, bs)
    hidden = drafter.final_hidden(query_ids.flatten(1), query_positions.flatten(1), kv, mask, positions)
    logits = drafter.logits(hidden)  # [B, A*bs, V]
    # DSpark's Markov bias from the token at each slot's own position (index - 1; the anchor at slot 0, so never
    # below 0 where a bias applies: the clamp only keeps DFlash's anchor slot, which has none, inside the row)
    bias = drafter.slot_bias(input_ids.gather(1, (index - 1).clamp_min(0).flatten(1)))
    if bias is not None:
        logits = logits + bias

    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(b * n_anchors, bs)
    counted = counted.view(b * n_anchors, bs)
    weights = position_weights(ce, counted, weighting, dpace_alpha, gamma, first)
    total = counted.sum() if shard is None else shard.all_reduce(counted.sum())
    loss = (ce * weights).sum() / total.clamp_min(1)
    # a family's own loss per slot (DFlash2's selector), weighted over the slots as the block's cross-entropy is
    extra = drafter.extra_slot_loss(
        logits.view(*index.shape, -1), hidden.view(*index.shape, -1), labels, query_ids[..., 0]
    )
    if extra is not None and extra_weight:
        extra = extra.view(b * n_anchors, bs)
        extra_weights = position_weights(extra, counted, weighting, dpace_alpha, gamma, first)
        loss = loss + extra_weight * (extra * extra_weights).sum() / total.clamp_min(1)

    hit = (logits.argmax(-1).view_as(index) == labels).view(b * n_anchors, bs) & counted
    run = torch.cumprod(hit[:, first:].long(), dim=-1).sum(-1)  # a slot that does not count ends the run
    return BlockOutput(
        loss=loss,
        correct=hit.sum(0).detach(),
        counted=counted.sum(0).detach(),
        accepted_run=run.sum().detach(),
        anchors=valid.sum().detach(),
        slot_loss=((ce * counted).sum(0) / counted.sum(0).clamp_min(1)).detach(),
    )


def slot_labels(target_argmax: torch.Tensor, at: torch.Tensor, shard: ContextShard | None) -> torch.Tensor:
    """The target's argmax at global positions ``at`` [B, A, bs]. A shard holds rows [start, stop): every counted
    slot's lies there (the halo is the block size); the others (a DFlash anchor slot's, at a - 1) take any row, as
    they weigh nothing."""
    if shard is not None:
        rows = target_argmax.shape[1]
        if rows == 0:  # an empty share of a short row: no anchors of its own, nothing counts
            return torch.zeros_like(at)
        at = (at - shard.start).clamp(0, rows - 1)
    return target_argmax.gather(1, at.flatten(1)).view_as(at)


def context_kv(
    drafter: DFlashDrafter, aux: torch.Tensor, positions: torch.Tensor, shard: ContextShard | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's context keys and values over the whole row [B, L, nKV, d]: a shard projects its own positions'
    and all-gathers them, all layers in one collective (its backward returns each rank its keys' gradients)."""
    if shard is None:
        return drafter.context_kv(drafter.context(aux), positions)
    own = drafter.context_kv(drafter.context(shard.own(aux)), positions[:, shard.start : shard.end])
    whole = shard.gather(torch.stack([t for kv in own for t in kv], dim=2)).unbind(2)  # [B, L, 2 * layers, nKV, d]
    return list(zip(whole[0::2], whole[1::2], strict=True))


class BlockObjective(nn.Module):
    """``block_loss`` as a module's forward, so DDP / FSDP see a forward pass (their gradient sync hooks onto it).

    It takes the training loop's inputs (``training/features.py``'s ``Features`` as its family's ``Objective.reads``
    asks: ``target_argmax`` [B, L], the target's next token, where EAGLE-3 takes its logits) and answers with the
    loop's per-position figures: position k is the k-th drafting slot (``loss_k``, ``acc_k``, ``count_k``): DFlash's
    slot k+1, DSpark's slot k.

    With ``context`` the ranks of the group split each row (``block_loss``): each rank's loss is its share of the
    group's times the group's size, which the gradient averaging of DDP / FSDP divides out again, so a data-parallel
    group of P ranks weighs as one rank without context parallelism."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        max_anchors: int,
        weighting: str,
        dpace_alpha: float,
        gamma: float,
        context: ContextGroup | None = None,
        extra_weight: float = 1.0,
    ):
        super().__init__()
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown position weighting {weighting!r} (one of {WEIGHTINGS})")
        self.drafter, self.context = drafter, context
        self.max_anchors, self.weighting, self.dpace_alpha, self.gamma = max_anchors, weighting, dpace_alpha, gamma
        self.extra_weight = extra_weight  # of the drafter's extra_slot_loss (DFlash2's selector), when it has one

    @property
    def halo(self) -> int:
        """Positions past a rank's own whose target argmax its blocks read (``ContextGroup.cut``)."""
        return self.drafter.config.block_size

    @property
    def positions(self) -> int:
        """Draft positions per block: every slot but DFlash's anchor."""
        return self.drafter.config.block_size - self.drafter.first_drafting_slot

    def forward(
        self, aux, input_ids, target_argmax, loss_mask, attention_mask, target_in_draft=None, position_ids=None
    ):
        out = block_loss(
            self.drafter,
            aux,
            target_argmax,
            input_ids,
            loss_mask,
            attention_mask,
            position_ids,
            max_anchors=self.max_anchors,
            weighting=self.weighting,
            dpace_alpha=self.dpace_alpha,
            gamma=self.gamma,
            context=self.context,
            extra_weight=self.extra_weight,
        )
        loss = out.loss if self.context is None else out.loss * self.context.size
        first = self.drafter.first_drafting_slot
        counted = out.counted[first:].tolist()
        acc = [c / n if n else 0.0 for c, n in zip(out.correct[first:].tolist(), counted, strict=True)]
        loss_k = [float(out.slot_loss[k]) for k in range(first, first + self.positions)]
        return loss, StepFigures(loss=loss, loss_k=loss_k, acc_k=acc, count_k=[int(n) for n in counted])

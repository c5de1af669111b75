"""Training-time test (TTT): the EAGLE-3 loss that trains the drafter on its own multi-step outputs.

Step 0 runs the drafter on the target's fused features; each further step k feeds the drafter's
own outputs of step k-1 back in as features (``drafter.next_feature``: pre-norm, or normed with
``norm_output``), with the ground-truth tokens shifted by k, exactly as it will run when drafting k
tokens ahead (docs/formats.md §12).

Attention at step k >= 1 for the chain that starts at position t covers the step-0 keys 0..t plus
the keys of steps 1..k at that same chain (one key per step, not an L x L matrix per step). The
step-0 part is a causal attention over a fixed set of keys; it runs through ``_PrefixAttention``,
which returns output and log-sum-exp and recomputes the scores block by block in backward, so no
L x L matrix is kept for backward. Its result is merged with the per-chain dot products by
log-sum-exp, which is exact.

Chains are independent after step 0 (they only share the step-0 keys), so steps >= 1 compute only
the chains that still have a counted position ahead, packed into one row dimension: prompt
positions and the sequence tail drop out after step 0.

Packed rows (several documents in one row, ``position_ids`` restarting at 0 at each document) need no
other machinery: a position's keys start at its document's start instead of its row's (the ``lo`` of
``_PrefixAttention``, which then also runs step 0), RoPE positions are the position ids, and a chain
counts only targets inside its own document.

The draft head and its loss run once, over the rows of every step, through ``training/head_loss.py`` (no [N, Vd]
tensor kept for backward). What the loss is besides the batch (steps, their weights, the divergence, the
normalisation) comes in as one ``TTTConfig``, the config's ``train.ttt`` section.

Context parallelism (``kernels.context``, training/context_parallel.py) splits every row's positions over ranks:
each runs step 0 on its own positions, all-gathers the step-0 keys and values (the only keys another rank's chains
read: a chain's draft keys stay where it lives), and computes the chains that start in its positions. Flat indices
stay global (b*L + t), so document starts, the window and causality are the same spans as in one process.

This file is the reference (and the CPU path); ``kernels`` (training/fused.py) swaps in the fused GPU
attention of training/attention.py and a compiled head loss, tested equal to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eaglekit.config import StepWeights, TTTConfig
from eaglekit.drafters.eagle3.attention import causal_attention, span_attention
from eaglekit.drafters.eagle3.fused import REFERENCE, StepKernels
from eaglekit.drafters.eagle3.head_loss import HeadTargets, head_soft_cross_entropy
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.errors import UsageError
from eaglekit.model.layers import repeat_kv, sdpa
from eaglekit.training.context_parallel import ContextShard
from eaglekit.training.figures import StepFigures

# Blocks of _PrefixAttention: at most this many score elements (rows x keys x heads), bounding the transient
# memory, and at most BLOCK_ROWS rows, so a block's key range stops near its last row (causal work is ~halved).
BLOCK_ELEMENTS = 1 << 24
BLOCK_ROWS = 256


class _PrefixAttention(torch.autograd.Function):
    """Attention of packed query rows over a contiguous range of keys each, returning output and log-sum-exp.

    q [N, nH, hd]; k [S, nKV, hd]; v [S, nKV, dv] (dv may differ from hd: MLA); row i attends keys lo[i]..hi[i]
    (inclusive). Rows must be sorted so lo and hi are non-decreasing. Only q, k, v, the output and the
    log-sum-exp are kept for backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale):
        n, n_heads, hd = q.shape
        n_kv = k.shape[1]
        groups = n_heads // n_kv
        dtype = torch.promote_types(q.dtype, torch.float32)
        qp = q.to(dtype).view(n, n_kv, groups, hd).permute(1, 2, 0, 3).contiguous()  # [nKV, g, N, hd]
        kp = k.to(dtype).permute(1, 0, 2).contiguous()  # [nKV, S, hd]
        vp = v.to(dtype).permute(1, 0, 2).contiguous()
        out = qp.new_empty((*qp.shape[:-1], v.shape[-1]))
        lse = qp.new_empty(qp.shape[:-1])
        blocks = _blocks(lo, hi, n_heads)
        for r0, r1, s0, s1 in blocks:
            p, lse_block = _scores(qp, kp, lo, hi, scale, r0, r1, s0, s1)
            lse[:, :, r0:r1] = lse_block
            out[:, :, r0:r1] = p @ vp[:, None, s0:s1]
        ctx.save_for_backward(qp, kp, vp, out, lse, lo, hi)
        ctx.blocks, ctx.scale, ctx.dtypes = blocks, scale, (q.dtype, k.dtype, v.dtype)
        # explicit widths: a step that no chain reaches (every document shorter than the chain) has n = 0
        return (
            out.permute(2, 0, 1, 3).reshape(n, n_heads, v.shape[-1]).to(q.dtype),
            lse.permute(2, 0, 1).reshape(n, n_heads),
        )

    @staticmethod
    def backward(ctx, d_out, d_lse):
        qp, kp, vp, out, lse, lo, hi = ctx.saved_tensors
        n_kv, groups, n, hd = qp.shape
        scale = ctx.scale
        do = d_out.to(qp.dtype).view(n, n_kv, groups, d_out.shape[-1]).permute(1, 2, 0, 3)
        dl = torch.zeros_like(lse) if d_lse is None else d_lse.to(qp.dtype).view(n, n_kv, groups).permute(1, 2, 0)
        # dS = P * (dP - rowsum(dO * O) + dLSE): the softmax backward with the log-sum-exp output folded in.
        delta = (do * out).sum(-1) - dl
        dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
        for r0, r1, s0, s1 in ctx.blocks:
            p, _ = _scores(qp, kp, lo, hi, scale, r0, r1, s0, s1, lse=lse[:, :, r0:r1])
            do_b = do[:, :, r0:r1]
            dv[:, s0:s1] += (p.transpose(-1, -2) @ do_b).sum(1)
            ds = (do_b @ vp[:, None, s0:s1].transpose(-1, -2)).sub_(delta[:, :, r0:r1, None]).mul_(p)
            dq[:, :, r0:r1] = (ds @ kp[:, None, s0:s1]) * scale
            dk[:, s0:s1] += (ds.transpose(-1, -2) @ qp[:, :, r0:r1]).sum(1) * scale
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return (
            dq.permute(2, 0, 1, 3).reshape(n, n_kv * groups, hd).to(q_dtype),
            dk.permute(1, 0, 2).to(k_dtype),
            dv.permute(1, 0, 2).to(v_dtype),
            None,
            None,
            None,
        )


def _blocks(lo: torch.Tensor, hi: torch.Tensor, n_heads: int) -> list[tuple[int, int, int, int]]:
    """Row blocks (r0, r1) and the key range (s0, s1) they need, sized to about BLOCK_ELEMENTS scores."""
    n = lo.numel()
    span = int((hi - lo).max().item()) + 1 if n else 1
    rows = max(1, min(BLOCK_ROWS, BLOCK_ELEMENTS // (n_heads * span)))
    starts = list(range(0, n, rows))
    ends = [min(r + rows, n) for r in starts]
    lo_b = lo[torch.tensor(starts, device=lo.device)].tolist() if n else []
    hi_b = hi[torch.tensor([e - 1 for e in ends], device=hi.device)].tolist() if n else []
    return [(r0, r1, s0, s1 + 1) for r0, r1, s0, s1 in zip(starts, ends, lo_b, hi_b, strict=False)]


def _scores(qp, kp, lo, hi, scale, r0, r1, s0, s1, lse=None):
    """Softmax probabilities [nKV, g, rows, keys] of one block (and its log-sum-exp when not given)."""
    s = (qp[:, :, r0:r1] @ kp[:, None, s0:s1].transpose(-1, -2)).mul_(scale)
    keys = torch.arange(s0, s1, device=s.device)
    blocked = (keys[None, :] < lo[r0:r1, None]) | (keys[None, :] > hi[r0:r1, None])
    s.masked_fill_(blocked, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return s.sub_(lse[..., None]).exp_(), lse


@dataclass(frozen=True)
class TTTBatch:
    """One right-padded batch as ``ttt_loss`` reads it (its docstring gives the conventions); with a context shard
    ``aux_hidden``, ``target_logits`` and ``target_in_draft`` hold that rank's rows [start, stop) of each row."""

    aux_hidden: torch.Tensor  # [B, L, 3 * target hidden]
    input_ids: torch.Tensor  # [B, L]
    target_logits: torch.Tensor  # [B, L, draft vocab]
    loss_mask: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None = None  # [B, L]; None: no padding
    target_in_draft: torch.Tensor | None = None  # [B, L]; None: every target argmax is in the draft vocabulary
    position_ids: torch.Tensor | None = None  # [B, L] packed rows; None: one document per row


def _check_inputs(drafter: Eagle3Drafter, batch: TTTBatch, steps: int, shard: ContextShard | None) -> None:
    """The batch's shapes against the drafter, ``steps`` (the settings' step count), the padding and packing."""
    cfg = drafter.config
    b, length = batch.input_ids.shape
    rows = length if shard is None else shard.stop - shard.start  # context parallel: this rank's rows and halo
    expect = {
        "aux_hidden": (batch.aux_hidden, (b, rows, 3 * cfg.target_hidden_size)),
        "target_logits": (batch.target_logits, (b, rows, cfg.draft_vocab_size)),
        "loss_mask": (batch.loss_mask, (b, length)),
        "attention_mask": (batch.attention_mask, (b, length)),
        "target_in_draft": (batch.target_in_draft, (b, rows)),
        "position_ids": (batch.position_ids, (b, length)),
    }
    for name, (tensor, shape) in expect.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise UsageError(
                f"ttt_loss: {name} has shape {list(tensor.shape)}, expected {list(shape)}",
                "the feature batch does not match the drafter (rerun extract for this drafter config)",
            )
    if steps < 1:
        raise UsageError(f"ttt_loss: steps must be >= 1, got {steps}", "set train.ttt.steps to 1 or more")
    attention_mask, position_ids = batch.attention_mask, batch.position_ids
    if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise UsageError(
            "ttt_loss: attention_mask is not right-padded (a real token follows a pad)", "pad sequences on the right"
        )
    if position_ids is not None and length:
        step = position_ids[:, 1:] - position_ids[:, :-1]
        if bool((position_ids[:, 0] != 0).any()) or bool(((position_ids[:, 1:] != 0) & (step != 1)).any()):
            raise UsageError(
                "ttt_loss: position_ids must start each row at 0 and count up by one within a "
                "document, restarting at 0 where the next document begins",
                "build packed rows with eaglekit.training.data.collate_packed",
            )


@dataclass
class _Positions:
    """Which (chain, step) pairs count, and how each step's summed loss is normalised."""

    positions: torch.Tensor  # [B, L] RoPE position of each position inside its document
    flat_doc_start: torch.Tensor  # [B*L] flat index where each position's document starts
    packed: bool  # some row holds more than one document
    usable: torch.Tensor  # [B, L] token j may be a prediction target
    counted: torch.Tensor  # [steps, B, L] chain t counts at step k
    needed: torch.Tensor  # [steps, B, L] chain t counts at step k or later
    count_k: torch.Tensor  # [steps] counted positions
    position_weight: torch.Tensor | None  # [steps, B*L] share of its step's loss before the normalizer
    denominator: torch.Tensor  # [steps] what each step's summed loss is divided by
    own_rows: torch.Tensor  # flat indices b*L + t of the chains this process computes: all of them, or its shard's
    shard: ContextShard | None = None  # context parallel: this rank's positions of every row
    window: int | None = None  # the drafter's sliding window (positions a query sees, its own included)

    def first_key(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The first step-0 key (flat index) that chain ``rows`` sees at draft step ``step``: its document's start,
        or, with a window, the oldest position inside it — the query sits at position t + step, as in serving."""
        start = self.flat_doc_start[rows]
        if self.window is None:
            return start
        return torch.maximum(start, rows + step - self.window + 1)


@dataclass
class _HeadRows:
    """Per step: the counted chains' pre-norm outputs, their target slots and their flat positions."""

    rows: list[torch.Tensor]
    slots: list[torch.Tensor]
    pos: list[torch.Tensor]

    def add(self, h: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
        self.rows.append(h)
        self.slots.append(slots)
        self.pos.append(pos)


def _positions(
    batch: TTTBatch,
    steps: int,
    normalization: str,
    normalizer: Callable[[torch.Tensor], torch.Tensor] | None,
    shard: ContextShard | None = None,
) -> _Positions:
    """The masks of the batch: counted (chain, step) pairs, the chains still needed, and each step's normaliser.
    With a context shard, only the shard's chains count here (target_in_draft covers its rows [start, stop))."""
    input_ids, attention_mask, target_in_draft = batch.input_ids, batch.attention_mask, batch.target_in_draft
    position_ids = batch.position_ids
    b, length = input_ids.shape
    device = input_ids.device
    positions = torch.arange(length, device=device).expand(b, length) if position_ids is None else position_ids
    # doc_start[b, t]: where t's document starts in its row (0 for every t of an unpacked row)
    doc_start = torch.arange(length, device=device) - positions
    packed = bool(doc_start.any())

    # usable[b, j]: token j may be a prediction target.
    usable = batch.loss_mask.bool()
    if attention_mask is not None:
        usable = usable & attention_mask.bool()
    if target_in_draft is not None:
        in_draft = target_in_draft.bool()
        if shard is not None:  # the shard's chains read in_draft[start+1 .. stop-1] only; the rest is never counted
            in_draft = F.pad(in_draft, (shard.start, length - shard.stop), value=True)
        usable = usable & F.pad(in_draft[:, :-1], (1, 0), value=False)
    # counted[k, b, t] = usable[b, t+2+k] and t+2+k in t's document; needed[k] = chain t counts at step k or later.
    counted = torch.zeros(steps, b, length, dtype=torch.bool, device=device)
    for k in range(min(steps, length - 2)):
        counted[k, :, : length - 2 - k] = usable[:, 2 + k :] & (doc_start[:, 2 + k :] == doc_start[:, : length - 2 - k])
    if shard is not None:  # the other ranks' chains are theirs to count
        counted[:, :, : shard.start] = False
        counted[:, :, shard.end :] = False
    needed = counted.flip(0).cumsum(0).flip(0) > 0
    count_k = counted.reshape(steps, -1).sum(-1)
    flat_doc_start = (torch.arange(b, device=device)[:, None] * length + doc_start).reshape(-1)
    position_weight = None
    if normalization == "sequence":
        per_doc = torch.zeros(steps, b * length, dtype=torch.float64, device=device).index_add_(
            1, flat_doc_start, counted.reshape(steps, -1).double()
        )
        if shard is not None:  # a document's positions may lie on several ranks: its count is theirs together
            per_doc = shard.all_reduce(per_doc)
        position_weight = 1.0 / per_doc[:, flat_doc_start].clamp(min=1)
        units = (per_doc > 0).sum(-1)
        if shard is not None and shard.context.rank:  # every rank of the group now sees every document: one counts
            units = torch.zeros_like(units)
    elif normalization == "token":
        units = count_k
    else:
        raise UsageError(
            f"ttt_loss: normalization {normalization!r}", "set train.ttt.loss_normalization to token or sequence"
        )
    if normalizer is not None:
        denominator = normalizer(units)
    else:  # the whole batch's count: under context parallelism, the group's
        denominator = units if shard is None else shard.all_reduce(units.clone())
    return _Positions(
        positions=positions,
        flat_doc_start=flat_doc_start,
        packed=packed,
        usable=usable,
        counted=counted,
        needed=needed,
        count_k=count_k,
        position_weight=position_weight,
        denominator=denominator,
        own_rows=torch.arange(b * length, device=device) if shard is None else shard.own_rows(b, device),
        shard=shard,
    )


def _targets(
    target_logits: torch.Tensor, usable: torch.Tensor, compute: torch.dtype, shard: ContextShard | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target probabilities and argmax of every position j with usable[j+1], and slot[j]: j's row in them (or -1).
    With a context shard, target_logits holds rows [start, stop) of each row, and only those are taken."""
    # Every step's targets are target_logits[j] for positions j with usable[j+1]: softmax those once.
    b, length = usable.shape
    device = usable.device
    wanted = F.pad(usable[:, 1:], (0, 1), value=False)
    start, stop = (0, length) if shard is None else (shard.start, shard.stop)
    wanted[:, :start] = False
    wanted[:, stop:] = False
    target_pos = wanted.reshape(-1).nonzero().squeeze(1)
    slot = torch.full((b * length,), -1, dtype=torch.long, device=device)
    slot[target_pos] = torch.arange(target_pos.numel(), device=device)
    local = target_pos // length * (stop - start) + target_pos % length - start  # the row in target_logits
    with torch.no_grad():
        target_rows = target_logits.reshape(b * (stop - start), target_logits.shape[-1])[local]  # may be empty
        target_p, target_argmax = torch.softmax(target_rows.to(compute), dim=-1), target_rows.argmax(-1)
    return target_p, target_argmax, slot


def _prefix_attention(q, k, v, lo, hi, scale) -> torch.Tensor:
    """_PrefixAttention's output alone (span_attention's signature, for step 0's packed or windowed rows)."""
    return _PrefixAttention.apply(q, k, v, lo, hi, scale)[0]


def _layer_pass(kernels: StepKernels, body: Callable[..., tuple], *inputs: torch.Tensor) -> tuple:
    """``body(*inputs)``: one TTT step's layers. With ``kernels.checkpoint_steps`` their activations are not kept for
    backward but recomputed there (only the inputs and outputs stay), so a step costs O(rows x H) instead of the
    layers' full width per row."""
    if kernels.checkpoint_steps and torch.is_grad_enabled():
        return checkpoint(body, *inputs, use_reentrant=False)
    return body(*inputs)


def _step0(
    drafter: Eagle3Drafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor, at: _Positions, kernels: StepKernels
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Step 0 on the whole [B, L] (or a context shard's [B, n] positions of it): the last layer's pre-norm outputs
    [B*n, H] in the order of ``at.own_rows``, and each layer's keys, values [B, L, nKV, hd] of every position
    (gathered from the group). Each layer attends its own keys; a layer above the first reads the one below's output."""
    layers = drafter.decoder_layers
    b, length = input_ids.shape
    shard = at.shard
    start, end = (0, length) if shard is None else (shard.start, shard.end)
    n = end - start
    with torch.no_grad():
        embeds = drafter.embed_tokens(F.pad(input_ids[:, 1:], (0, 1))[:, start:end])
    positions = at.positions[:, start:end]
    own = aux_hidden if shard is None else shard.own(aux_hidden)
    # keys first_key..t of the flat rows, not a plain causal mask (a shard's queries sit at an offset in the keys)
    spans = at.packed or at.window is not None or shard is not None
    rows = at.own_rows

    def body(aux_hidden: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = drafter.fuse(aux_hidden)
        cos, sin = drafter.rotary(positions, hidden.dtype)
        keys, values = [], []
        for layer in layers:
            n_heads, n_kv, hd, dv = layer.n_heads, layer.n_kv, layer.head_dim, layer.v_dim  # dv != hd for MLA
            q, k0, v0 = layer.qkv(embeds, hidden, cos, sin)  # [B, n, heads, hd]
            if shard is not None:  # every position's keys, for this shard's queries and every later step's
                k0, v0 = shard.gather(k0), shard.gather(v0)
            if spans:  # a causal attention inside each document (and window): the fused kernel or the reference
                span = span_attention if kernels.attention == "flex" else _prefix_attention
                attn = span(
                    q.reshape(b * n, n_heads, hd),
                    k0.reshape(b * length, n_kv, hd),
                    v0.reshape(b * length, n_kv, dv),
                    at.first_key(rows, 0),
                    rows,
                    layer.scale,
                ).view(b, n, n_heads, dv)
            elif kernels.attention != "reference":
                attn = causal_attention(q, k0, v0, layer.scale)
            else:
                attn = sdpa(
                    q.transpose(1, 2),
                    repeat_kv(k0.transpose(1, 2), n_heads // n_kv),
                    repeat_kv(v0.transpose(1, 2), n_heads // n_kv),
                    layer.scale,
                    is_causal=True,
                ).transpose(1, 2)
            hidden = layer.finish(attn, hidden)  # [B, n, H]; n may be 0
            keys.append(k0)
            values.append(v0)
        return hidden.flatten(0, 1), *keys, *values

    h, *kv = _layer_pass(kernels, body, own, embeds)
    return h, kv[: len(layers)], kv[len(layers) :]


def _chain_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    starts: torch.Tensor,
    rows: torch.Tensor,
    diag_k: torch.Tensor,
    diag_v: torch.Tensor,
    scale: float,
    kernels: StepKernels,
) -> torch.Tensor:
    """Attention of chains ``rows`` (q [N, nH, hd]) over step-0 keys starts..rows and their own keys of steps 1..k."""
    if kernels.attention == "flex":  # one kernel over the step-0 span and the chain's own keys
        return span_attention(q, k0, v0, starts, rows, scale, diag_k, diag_v)
    n, n_heads, hd = q.shape
    n_kv, dv = k0.shape[1], v0.shape[-1]
    groups = n_heads // n_kv
    out_prefix, lse_prefix = _PrefixAttention.apply(q, k0, v0, starts, rows, scale)
    lse_prefix = lse_prefix.view(n, n_kv, groups)  # float32 or wider, like the merge below
    diag_scores = torch.einsum("nkgd,snkd->snkg", q.view(n, n_kv, groups, hd), diag_k).to(lse_prefix.dtype) * scale
    lse_all = torch.logsumexp(torch.cat([lse_prefix[None], diag_scores]), dim=0)  # [N, nKV, g]
    return torch.exp(lse_prefix - lse_all)[..., None] * out_prefix.view(n, n_kv, groups, dv) + torch.einsum(
        "snkg,snkd->nkgd", torch.exp(diag_scores - lse_all), diag_v.to(lse_all.dtype)
    )


def _draft_steps(
    drafter: Eagle3Drafter,
    h: torch.Tensor,
    k0: list[torch.Tensor],
    v0: list[torch.Tensor],
    input_ids: torch.Tensor,
    at: _Positions,
    slot: torch.Tensor,
    steps: int,
    kernels: StepKernels,
    head: _HeadRows,
) -> None:
    """Steps >= 1 on the packed chains that still count, adding each step's counted rows to ``head``. Every step runs
    every layer; layer i of chain f attends layer i's step-0 keys and its own keys of the chain's earlier steps."""
    layers = drafter.decoder_layers
    n_layers = len(layers)
    b, length = input_ids.shape
    # Chain f = b*L + t sees step-0 keys doc start .. f.
    k0 = [k.reshape(b * length, layer.n_kv, layer.head_dim) for k, layer in zip(k0, layers, strict=True)]
    v0 = [v.reshape(b * length, layer.n_kv, layer.v_dim) for v, layer in zip(v0, layers, strict=True)]
    ids_flat = input_ids.reshape(-1)
    pos_flat = at.positions.reshape(-1)
    rows = at.own_rows  # the chains whose step-0 outputs ``h`` holds, in its order
    # the keys and values steps 1..k made, each in the rows of its own step: a step gathers its chains' from them
    # (chains only drop out, and rows stay sorted), so nothing grows with the step count but the steps' own keys;
    # step s's layer i at [s * n_layers + i]
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    own_rows: list[torch.Tensor] = []
    for k in range(1, steps):
        keep = at.needed[k].reshape(-1)[rows]
        rows = rows[keep]
        gather = [torch.searchsorted(earlier, rows) for earlier in own_rows]
        first_key, next_ids = at.first_key(rows, k), ids_flat[rows + 1 + k]

        # Everything the step reads is bound now, not looked up when backward recomputes it (the loop has moved on
        # by then); its inputs are the previous step's output and the earlier steps' keys, which are kept anyway.
        def body(
            h_prev: torch.Tensor,
            *own: torch.Tensor,
            keep: torch.Tensor = keep,
            chain_rows: torch.Tensor = rows,
            gather: list[torch.Tensor] = gather,
            first: torch.Tensor = first_key,
            token_ids: torch.Tensor = next_ids,
            step: int = k,
        ) -> tuple[torch.Tensor, ...]:
            keys, values = own[: len(own) // 2], own[len(own) // 2 :]
            embeds, hidden = drafter.draft_step_input(h_prev[keep], token_ids)
            cos, sin = drafter.rotary(pos_flat[chain_rows] + step, hidden.dtype)
            made_k, made_v = [], []
            for j, layer in enumerate(layers):
                q, kk, vk = layer.qkv(embeds, hidden, cos, sin)  # q [N, nH, hd], kk/vk [N, nKV, hd]
                earlier = range(j, len(keys), n_layers)  # this layer's keys of the earlier steps
                diag_k = torch.stack([keys[e][i] for e, i in zip(earlier, gather, strict=True)] + [kk])
                diag_v = torch.stack([values[e][i] for e, i in zip(earlier, gather, strict=True)] + [vk])
                attn = _chain_attention(q, k0[j], v0[j], first, chain_rows, diag_k, diag_v, layer.scale, kernels)
                hidden = layer.finish(
                    attn.reshape(chain_rows.numel(), layer.n_heads, layer.v_dim).to(hidden.dtype), hidden
                )
                made_k.append(kk)
                made_v.append(vk)
            return hidden, *made_k, *made_v

        h, *made = _layer_pass(kernels, body, h, *own_k, *own_v)
        own_k.extend(made[:n_layers])
        own_v.extend(made[n_layers:])
        own_rows.append(rows)
        sel = at.counted[k].reshape(-1)[rows]
        head.add(h[sel], slot[rows[sel] + 1 + k], rows[sel])


def _row_weights(
    head: _HeadRows, at: _Positions, weights: StepWeights, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head row's step and its weight w_k / denominator_k (times its document share under "sequence")."""
    device = at.count_k.device
    sizes = [r.shape[0] for r in head.rows]
    step_of_row = torch.repeat_interleave(torch.arange(len(weights), device=device), torch.tensor(sizes, device=device))
    per_step = torch.tensor(weights, dtype=compute, device=device)
    per_step = torch.where(at.denominator > 0, per_step / at.denominator.clamp(min=1).to(compute), 0.0)
    row_weight = per_step[step_of_row]
    if at.position_weight is not None:
        row_weight = row_weight * at.position_weight[step_of_row, torch.cat(head.pos)].to(compute)
    return step_of_row, row_weight


def ttt_loss(
    drafter: Eagle3Drafter,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    target_in_draft: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    settings: TTTConfig | None = None,
    kernels: StepKernels = REFERENCE,
    normalizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepFigures:
    """The TTT loss of one right-padded batch.

    Conventions (t indexes positions 0..L-1 of a row):
      - ``target_logits[b, t]`` are the target's logits at position t (predicting token t+1), already
        restricted to the draft vocabulary (``logits[..., t2d]``).
      - ``target_in_draft[b, t]`` (optional) says the target's argmax over the FULL vocabulary at
        position t lies inside the draft vocabulary; positions where it does not are not counted.
      - ``position_ids[b, t]`` (optional, packed rows) is t's position inside its document: 0 where a
        document starts. Without it every row is one document (positions 0..L-1).
      - Step 0: the feature fc(aux_hidden[t]) with the embedding of token t+1, at RoPE position
        position_ids[t], predicts softmax(target_logits[t+1]), i.e. token t+2; it attends the keys of
        its own document up to t.
      - Step k: the drafter's pre-norm output of step k-1 at chain t replaces the feature, the
        embedding of token t+1+k goes in, RoPE position position_ids[t]+k, target softmax(target_logits[t+1+k]).
      - (t, k) is counted where token t+2+k exists in t's document, is not padding, has loss_mask 1,
        and (if given) target_in_draft[t+1+k]. Padding must be on the right.
    ``settings`` (the config's train.ttt) gives the steps k = 0..settings.steps-1, their weights w_k
    (``settings.weights``: step_weights, else decay^k), the divergence and the normalisation.
    Loss_k = the divergence ``settings.loss`` (``eaglekit/divergences.py``; default kl_div, reported as the soft
    cross-entropy) summed over counted (t, k), divided by ``normalizer(count_k)`` (default: count_k itself, i.e. the
    mean; under DDP the count of every rank); loss = sum_k w_k * loss_k.
    ``loss_normalization: sequence``: each document's positions at step k are averaged first, then the documents
    (``normalizer`` then counts documents with a counted position, not positions), so long sequences do not
    dominate. The reported loss_k / acc_k stay per-position means either way.
    ``kernels`` picks the fused GPU kernels (training/fused.py); the default is this file's reference.
    With ``kernels.context`` (context parallelism) ``aux_hidden``, ``target_logits`` and ``target_in_draft`` hold this
    rank's rows [start, stop) of each row (``ContextShard``: its positions and a halo of ``steps`` targets), the rest
    stays whole; the loss and figures are this rank's chains' (their losses over every rank's count), so the ranks'
    losses and gradients add up to the single process's.
    """
    settings = TTTConfig() if settings is None else settings  # the config's defaults: 7 steps, 0.8^k, kl_div
    weights = settings.weights
    steps = len(weights)
    shard = None if kernels.context is None else kernels.context.shard(input_ids.shape[1], steps)
    batch = TTTBatch(aux_hidden, input_ids, target_logits, loss_mask, attention_mask, target_in_draft, position_ids)
    _check_inputs(drafter, batch, steps, shard)
    at = _positions(batch, steps, settings.loss_normalization, normalizer, shard)
    at.window = drafter.config.sliding_window
    if at.window is not None and at.window <= steps:
        raise UsageError(
            f"ttt_loss: a sliding window of {at.window} positions is shorter than the {steps} TTT steps: the last "
            "steps' own draft keys would leave the window",
            "use a window longer than train.ttt.steps (windows are hundreds to thousands of positions)",
        )
    compute = torch.promote_types(drafter.lm_head.weight.dtype, torch.float32)
    target_p, target_argmax, slot = _targets(target_logits, at.usable, compute, shard)

    # Step 0: every position is a key for later steps, so it runs on the whole [B, L] (context parallel: each rank
    # on its positions, their keys gathered).
    h, k0, v0 = _step0(drafter, aux_hidden, input_ids, at, kernels)
    head = _HeadRows([], [], [])
    sel0 = at.counted[0].reshape(-1)[at.own_rows]
    rows0 = at.own_rows[sel0]
    head.add(h[sel0], slot[rows0 + 1], rows0)
    _draft_steps(drafter, h, k0, v0, input_ids, at, slot, steps, kernels, head)
    del h, k0, v0  # what backward needs of them it holds itself: not alive beside the head loss's temporaries

    # The head and loss of every step in one pass: row weight w_k / denominator_k.
    step_of_row, row_weight = _row_weights(head, at, weights, compute)
    rows = torch.cat(head.rows)
    head.rows.clear()  # the per-step pieces are in ``rows`` now
    # checkpointed, the final norm keeps only its input (its float32 internals are recomputed in backward)
    (normed,) = _layer_pass(kernels, lambda x: (drafter.norm(x),), rows)
    result = head_soft_cross_entropy(
        normed,
        drafter.lm_head.weight,
        HeadTargets(target_p, target_argmax, torch.cat(head.slots), row_weight),
        settings.loss,
        chunk_fn=kernels.head_chunk,
    )

    device = input_ids.device
    sums = torch.zeros(steps, dtype=compute, device=device).index_add_(0, step_of_row, result.value)
    hits = torch.zeros(steps, dtype=compute, device=device).index_add_(0, step_of_row, result.correct.to(compute))
    counts = at.count_k.tolist()
    loss_k = [s / c if c else 0.0 for s, c in zip(sums.double().tolist(), counts, strict=False)]
    acc_k = [a / c if c else 0.0 for a, c in zip(hits.tolist(), counts, strict=False)]
    return StepFigures(loss=result.loss, loss_k=loss_k, acc_k=acc_k, count_k=counts)

"""The DFlash2 block drafter: DFlash (``drafters/dflash/model.py``) with a grouped dynamic convolution around every
sublayer and a predecessor-conditioned top-K path selector over the block.

Read from vLLM 0.32 (``model_executor/models/qwen3_dflash2.py``: ``DFlashGroupedConv``, ``DFlash2Qwen3DecoderLayer``,
``CandidateSelector``; ``v1/worker/gpu/spec_decode/dflash2/speculator.py``: the walk) and speculators
(``models/dflash2``). What it adds to DFlash's layers and head, with H the hidden size, G = H / conv_group_size
groups and T = conv_kernel_size taps:

- a convolution before and after the attention and before and after the MLP of every layer, along the block and
  causal within it (slot p reads slots p, p-1, ..., p-T+1 of its own block, never the context):

      (x, k_out) = conv.prepare(x):  k = kernel_projection(x) -> [2, T, G];  x <- conv(x, base_kernel[0] + k[0])
      y = sublayer(x);               y <- conv(y, base_kernel[1] + k_out)        (k_out = k[1], from the input)
      conv(x, c)[p] = sum_t c[p, t] * x[p - t]   (per channel; a group's channels share k's coefficient)

  base_kernel [2, T, H] starts at the identity (tap 0 one, the rest zero) and kernel_projection at zero, as
  speculators starts it: an untrained DFlash2 layer is a DFlash layer.
- a selector that re-ranks the K candidates of each mask slot (the top K of DFlash's logits u):

      score(prev, c) = u[c] + < P[prev] * (W h), S[c] >        P, S [V, r] codebooks; W [r, H]; h the normed hidden

  where prev is the token drafted one slot before (the verified anchor for the first). vLLM's V2 runner walks it
  greedily left to right at temperature 0 (``draft_path``); per-slot argmax of u is plain DFlash decoding, which is
  all an engine that ignores the selector drafts.

Keys beyond DFlash's (vLLM prefixes ``model.``): ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, T, H],
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight`` [2*T*G, H], ``candidate_selector.predecessor_codebook``
and ``candidate_selector.successor_codebook`` [V, r], ``candidate_selector.hidden_projection.weight`` [r, H].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.config import DFlash2Draft, RunConfig
from eaglekit.drafters.dflash import model as dflash
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, DFlashLayer
from eaglekit.errors import UsageError

# speculators' DFlash2SpeculatorConfig defaults (the recipe its τ figures were measured with)
DEFAULT_KERNEL = 2
DEFAULT_GROUP = 16
DEFAULT_RANK = 256
DEFAULT_TOP_K = 16


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = DEFAULT_KERNEL  # taps of each convolution
    conv_group_size: int = DEFAULT_GROUP  # channels sharing one dynamic coefficient
    selector_rank: int = DEFAULT_RANK  # r of the selector's codebooks
    selector_top_k: int = DEFAULT_TOP_K  # candidates per slot the selector re-ranks

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            self._positive(name)
        if self.hidden_size % self.conv_group_size:
            raise UsageError(
                f"dflash2: conv_group_size {self.conv_group_size} does not divide the hidden size {self.hidden_size}",
                "set train.draft.conv_group_size to a divisor of the target's hidden size (vLLM refuses the rest)",
            )
        if self.conv_kernel_size > self.block_size:
            raise UsageError(
                f"dflash2: conv_kernel_size {self.conv_kernel_size} exceeds the block size {self.block_size}",
                "set train.draft.conv_kernel_size to at most train.draft.block_size (speculators' default is 2)",
            )
        if self.selector_top_k > self.vocab_size:
            raise UsageError(
                f"dflash2: selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})",
                "set train.draft.selector_top_k to at most the target's vocabulary size (default 16)",
            )


def config_for_run(cfg: RunConfig, hf_config: Any, aux_layer_ids: list[int], vocab_size: int) -> DFlash2Config:
    """The DFlash2 drafter a run's ``train.draft`` asks for: DFlash's backbone options, the convolution's and the
    selector's."""
    backbone = dflash.config_for_run(cfg, hf_config, aux_layer_ids, vocab_size)
    draft = cfg.train.draft_as(DFlash2Draft)
    return DFlash2Config(
        **backbone.to_dict(),
        conv_kernel_size=draft.conv_kernel_size or DEFAULT_KERNEL,
        conv_group_size=draft.conv_group_size or DEFAULT_GROUP,
        selector_rank=draft.selector_rank or DEFAULT_RANK,
        selector_top_k=draft.selector_top_k or DEFAULT_TOP_K,
    )


def block_convolution(x: torch.Tensor, coefficients: torch.Tensor, block: int) -> torch.Tensor:
    """x [B, Q, H] (Q whole blocks of ``block`` slots), coefficients [B, Q, T, H] -> sum over taps t of
    coefficients[:, p, t] * x[:, p - t], where p - t stays in p's block (zero before the block's first slot)."""
    b, q, h = x.shape
    taps = coefficients.shape[2]
    blocks = x.view(b, q // block, block, h)
    coefficients = coefficients.view(b, q // block, block, taps, h)
    out = coefficients[:, :, :, 0] * blocks
    for tap in range(1, min(taps, block)):
        shifted = F.pad(blocks[:, :, :-tap], (0, 0, tap, 0))  # slot p reads slot p - tap of its block
        out = out + coefficients[:, :, :, tap] * shifted
    return out.view(b, q, h)


class GroupedConvolution(nn.Module):
    """One sublayer's pair of convolutions (its input's and its output's), their coefficients predicted from the
    sublayer's input (vLLM's ``DFlashGroupedConv``)."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.groups, self.group = taps, hidden // group, group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _coefficients(self, side: int, delta: torch.Tensor) -> torch.Tensor:
        """[B, Q, T, G] per-group deltas -> [B, Q, T, H] coefficients of one side."""
        return self.base_kernel[side].to(delta.dtype) + delta.repeat_interleave(self.group, dim=-1)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return block_convolution(x, self._coefficients(0, delta[:, :, 0]), block), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return block_convolution(y, self._coefficients(1, delta.to(y.dtype)), block)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with a convolution pair around its attention and around its MLP."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__(cfg)
        assert isinstance(cfg, DFlash2Config)
        self.attention_conv = GroupedConvolution(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConvolution(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.block = cfg.block_size  # the queries' block length; the drafter sets it per forward (``final_hidden``)

    def forward(self, h, cos, sin, context_kv, mask) -> torch.Tensor:
        x, delta = self.attention_conv.prepare(self.input_layernorm(h), self.block)
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, context_kv, mask), delta, self.block)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h), self.block)
        return h + self.mlp_conv.finish(self.mlp(x), delta, self.block)


class CandidateSelector(nn.Module):
    """The low-rank predecessor/candidate scorer over the unary top K (vLLM's and speculators' ``CandidateSelector``)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=0.02)  # speculators' initializer_range

    def scores(
        self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """unary [..., V] logits, hidden [..., H], previous [...] token ids, candidates [..., K] -> [..., K]."""
        context = self.predecessor_codebook[previous] * self.hidden_projection(hidden).to(self.predecessor_codebook)
        edge = (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)
        return unary.gather(-1, candidates) + edge.to(unary.dtype)


class DFlash2Drafter(DFlashDrafter):
    """DFlash's drafter with DFlash2's layers and the selector (module docstring)."""

    family = "dflash2"
    layer_class = DFlash2Layer
    config: DFlash2Config

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.conv_layers: list[DFlash2Layer] = list(self.layers)  # type: ignore[arg-type]
        for layer in self.conv_layers:  # DFlash's normal(0, 0.02) init reached the projections: back to identity
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()
        self.candidate_selector = CandidateSelector(
            cfg.vocab_size, cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k
        )

    def final_hidden(
        self,
        query_ids: torch.Tensor,
        query_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DFlash's, with the convolutions told the block length: with a ``mask`` the queries are the objective's
        blocks of block_size (``drafters/dflash/objective.block_loss``); without one they are one drafting round's
        K+1 queries, one block whatever K, as vLLM convolves them (its block is 1 + num_speculative_tokens)."""
        queries, block = query_ids.shape[-1], self.config.block_size
        if mask is not None and queries % block:
            raise ValueError(f"{queries} queries are not whole blocks of {block}")
        for layer in self.conv_layers:
            layer.block = block if mask is not None else queries
        return super().final_hidden(query_ids, query_positions, context_kv, mask, context_positions)

    def selector_cross_entropy(
        self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The selector's K-way cross-entropy per slot (speculators' ``compute_selector_loss``): the candidates are
        the unary top K, the label's id put in place of the K-th where the top K lacks it, and the selector is asked
        for the label's place among them. logits [..., V], hidden [..., H], previous and labels [...] -> [...]."""
        candidates = logits.detach().topk(self.config.selector_top_k, dim=-1).indices
        found = candidates == labels.unsqueeze(-1)
        present = found.any(-1)
        candidates[..., -1] = torch.where(present, candidates[..., -1], labels)
        place = torch.where(present, found.long().argmax(-1), torch.full_like(labels, candidates.shape[-1] - 1))
        scores = self.candidate_selector.scores(logits, hidden, previous, candidates)
        return F.cross_entropy(scores.flatten(0, -2).float(), place.flatten(), reduction="none").view_as(labels)

    def extra_slot_loss(
        self, logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """The block objective's hook: per slot [B, A, bs] the selector's cross-entropy, each slot conditioned on
        the token an accepted path holds before it: the anchor for slot 1, then the previous slot's label (the
        target's argmax). speculators conditions on the row's own tokens, which differ where the data is not the
        target's greedy continuation. logits [B, A, bs, V], hidden [B, A, bs, H], labels [B, A, bs], anchor_ids
        [B, A]."""
        previous = torch.cat([anchor_ids[..., None], anchor_ids[..., None], labels[..., 1:-1]], dim=-1)
        return self.selector_cross_entropy(logits, hidden, previous, labels)

    @torch.no_grad()
    def draft_path(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: int) -> list[int]:
        """logits [K, V] and hidden [K, H] of one round's mask slots -> the K drafts vLLM's V2 runner takes at
        temperature 0 (``_selector_walk_kernel``): left to right, the best-scoring candidate given the one before."""
        candidates = logits.topk(self.config.selector_top_k, dim=-1).indices  # [K, top_k]
        previous = torch.tensor(anchor, device=logits.device)
        drafts = []
        for slot in range(logits.shape[0]):
            scores = self.candidate_selector.scores(logits[slot], hidden[slot], previous, candidates[slot])
            previous = candidates[slot, scores.argmax()]
            drafts.append(int(previous))
        return drafts

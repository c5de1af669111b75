"""The memory of one block-objective training step (DFlash, DSpark: ``training/block.py``) at a given row length,
in ``training/memory.py``'s parts, so that `plan` and the train pre-flight size and refuse a block drafter's rows
as they do EAGLE-3's.

What a step holds, for a row of L tokens and Q = anchors x block_size queries (anchors = min(max_anchors, L)):

- the batch: the row's aux features and the target's next token (``Features`` gives the block families the target's
  argmax, 8 bytes a token, computed a chunk of full-vocabulary logits at a time: ``model/target.target_argmax``;
  never the [L, V] fp32 logits EAGLE-3 reads, 43 GB for one 65,536-token row of a 163,840-token vocabulary);
- kept activations, in three terms: per context token (the aux states' cast for ``fc``, the context, and every
  layer's context keys and values, each concatenated with the block's and cast for attention), per query (the
  layers' activations, the [Q, V] fp32 logits and their log-softmax), and per (query, key) pair: the attention's
  [Q, L + Q] additive mask, kept once for all layers (``model/dflash.py``'s ``additive_mask``). Rather than hand
  counts they are measured from the code: ``block_loss`` runs at two row lengths and two anchor counts on small
  drafters with the run's layers, block size, head size, head grouping, window and aux taps, ``memory.Storages``
  adds up what is kept (as for EAGLE-3), the mixed difference gives the per-pair bytes and the single ones the
  per-token and per-query bytes; every kept tensor is [tokens or queries, width] for one of the widths (hidden,
  intermediate, key/value heads, vocabulary, Markov rank), so doubling each width gives the bytes at any width;
- the transient: the larger of the features' argmax (one chunk of logits, before any activation exists) and the
  step's own (the mask's construction, the logits' gradients).

The block objective has no activation checkpointing (``train.ttt.activation_checkpointing`` is TTT's): both figures
``step_memory`` answers for are the same step. ``benchmarks/train_memory.py --family dflash`` checks the model
against the measured peak of real steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.objective import block_loss
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.model.target import LOGIT_CHUNK_ELEMENTS
from eaglekit.training.memory import StepMemory, Storages, weight_bytes

# The widths a calibration drafter scales (DFlash's hidden size is the target's: both scale together; the key/value
# heads scale with the query heads in the run's grouping, the head size stays the run's)
BASE = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "markov_rank": 16,
    "selector_rank": 16,
}
ROWS = (96, 192)  # two row lengths: their difference is the per-context-token slope
ANCHORS = (2, 4)  # two anchor counts: their difference is the per-query slope
BATCH_INDEX_BYTES = 4 * 8  # a token's ids, loss and attention masks, positions (int64)
TARGET_BYTES = 8  # a token's target: the target's argmax (int64), all the block objective reads of it
PROJECTED, READ = "projected", "read"  # where a kept storage was made (``Kept``)


@dataclass(frozen=True)
class KeptBytes:
    """What a block step keeps for backward: bytes per context token it projects (the features' cast, the context,
    every layer's keys and values), per context token its blocks read (each layer's attention keeps its own copies
    of the row's keys and values), per query and per (query, key) pair; and the element size of the context's
    keys and values as context parallelism gathers them."""

    per_projected: float
    per_read: float
    per_query: float
    per_pair: float
    key_value_element: int

    def at(self, tokens: int, queries: int, own: int | None = None) -> int:
        """Bytes kept on a row of ``tokens``, with ``queries`` queries; ``own``: the positions this rank projects
        (all of them without context parallelism)."""
        projected = tokens if own is None else own
        return int(
            self.per_projected * projected
            + self.per_read * tokens
            + self.per_query * queries
            + self.per_pair * queries * (tokens + queries)
        )


def _calibration_config(cfg: DFlashConfig, **widths: int) -> DFlashConfig:
    fields: dict[str, Any] = {name: width for name, width in BASE.items() if hasattr(cfg, name)} | widths
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    # a window inside the calibration rows, so it is exercised
    window = None if cfg.sliding_window is None else min(cfg.sliding_window, ROWS[0] // 2)
    return dataclasses.replace(
        cfg,
        **fields,
        target_hidden_size=fields["hidden_size"],
        num_attention_heads=groups * fields["num_key_value_heads"],
        max_position_embeddings=max(cfg.max_position_embeddings, 2 * ROWS[1]),
        mask_token_id=0,
        sliding_window=window,
    )


@dataclass(frozen=True)
class Kept:
    """One block step's kept bytes, by where they were made (``kept_bytes``)."""

    projected: int  # made while making the context and its keys and values
    read: int  # made in the rest: the blocks' layers over the context, the logits, the loss
    key_value_element: int  # bytes of an element of the context's keys and values (the widest of the two)

    @property
    def total(self) -> int:
        return self.projected + self.read


def kept_bytes(
    cfg: DFlashConfig, rows: int, anchors: int, bf16: bool, drafter_class: type[DFlashDrafter] | None = None
) -> Kept:
    """What ``block_loss`` keeps for backward on one row of ``rows`` tokens with ``anchors`` anchored blocks: the
    storages it made that are alive when it returns (``memory.Storages``; parameters and inputs not counted,
    autocast's weight copies are: they are constant in the row), by where they were made."""
    torch.manual_seed(0)
    drafter = (drafter_class or (DSparkDrafter if isinstance(cfg, DSparkConfig) else DFlashDrafter))(cfg)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, rows, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=g)
    argmax = torch.randint(0, cfg.vocab_size, (1, rows), generator=g)
    element = [0]
    make_context, make_kv = drafter.context, drafter.context_kv
    made = Storages()

    def context(*args: Any) -> torch.Tensor:  # the context, then its keys and values: what a rank projects
        made.phase = PROJECTED
        return make_context(*args)

    def context_kv(*args: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = make_kv(*args)
        made.phase, element[0] = READ, max(t.element_size() for pair in out for t in pair)
        return out

    drafter.context, drafter.context_kv = context, context_kv  # type: ignore[method-assign,assignment]
    ones = torch.ones_like(ids)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    made.phase = READ
    with made, autocast:
        out = block_loss(drafter, aux, argmax, ids, ones, ones, max_anchors=anchors, generator=g)
    kept = Kept(made.alive(PROJECTED), made.alive(READ), element[0])
    del out
    return kept


def kept_per_shape(cfg: DFlashConfig, bf16: bool, drafter_class: type[DFlashDrafter] | None = None) -> KeptBytes:
    """What a block step of ``cfg``'s drafter (of ``drafter_class``: by default DFlash's, or DSpark's for its
    config) keeps per context token, per query and per (query, key) pair."""
    # classes are hashable (mypy takes a dataclass's __hash__ = None for its class's)
    return _kept(type(cfg), drafter_class, json.dumps(dataclasses.asdict(cfg), sort_keys=True), bf16)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=32)
def _kept(cls: type[DFlashConfig], drafter_class: type[DFlashDrafter] | None, cfg_json: str, bf16: bool) -> KeptBytes:
    cfg = cls.from_dict(json.loads(cfg_json))

    def slopes(c: DFlashConfig) -> KeptBytes:
        (l1, l2), (a1, a2) = ROWS, ANCHORS
        q1, q2 = a1 * c.block_size, a2 * c.block_size
        runs = [kept_bytes(c, n, a, bf16, drafter_class) for n, a in ((l1, a1), (l2, a1), (l1, a2), (l2, a2))]
        k11, k21, k12, k22 = (k.total for k in runs)
        pair = (k22 - k21 - k12 + k11) / ((l2 - l1) * (q2 - q1))
        context = (k21 - k11) / (l2 - l1) - pair * q1
        projected = (runs[1].projected - runs[0].projected) / (l2 - l1)
        query = (k12 - k11 - pair * (q2 * (l1 + q2) - q1 * (l1 + q1))) / (q2 - q1)
        return KeptBytes(projected, context - projected, query, pair, runs[0].key_value_element)

    base = _calibration_config(cfg)
    at_base = slopes(base)
    grown = dataclasses.asdict(at_base)
    for name in BASE:
        if not hasattr(cfg, name):
            continue
        unit = getattr(base, name)
        doubled = dataclasses.asdict(slopes(_calibration_config(cfg, **{name: 2 * unit})))
        for part in ("per_projected", "per_read", "per_query"):
            grown[part] += (doubled[part] - getattr(at_base, part)) / unit * (getattr(cfg, name) - unit)
    return KeptBytes(**{k: max(v, 0) for k, v in grown.items()})


def block_step_memory(
    cfg: DFlashConfig,
    row_length: int,
    rows: int,
    max_anchors: int,
    *,
    trainable: int,
    frozen: int,
    bf16: bool = True,
    context_parallel: int = 1,
    drafter_class: type[DFlashDrafter] | None = None,
) -> StepMemory:
    """The memory of one block step on ``rows`` rows of ``row_length`` tokens, for a drafter with ``trainable`` and
    ``frozen`` parameters (the target's embedding and head); ``bf16``: autocast as on a GPU, else fp32.

    ``context_parallel`` ranks splitting each row (``training/block.py``): one rank holds its share of the positions
    (their features and a block's halo, the projection of their context), the anchors among them, and the whole
    row's context keys and values (gathered), which its blocks read on every layer as one process's do."""
    act = 2 if bf16 else 4
    kept = kept_per_shape(cfg, bf16, drafter_class)
    own = math.ceil(row_length / context_parallel)
    anchors = min(max_anchors, row_length)
    if context_parallel > 1:  # the anchors are drawn over the whole row: the busiest rank's share, 3 sigma over
        share = anchors / context_parallel
        anchors = min(anchors, math.ceil(share + 3 * math.sqrt(share * (1 - 1 / context_parallel))))
    queries = anchors * cfg.block_size
    weights = weight_bytes(trainable, frozen, bf16=bf16, looked_up=cfg.vocab_size * cfg.hidden_size)  # the embedding
    aux_width = len(cfg.aux_layer_ids) * cfg.target_hidden_size
    held = own if context_parallel == 1 else min(own + cfg.block_size, row_length)  # its share and the halo
    batch = rows * held * (aux_width * act + TARGET_BYTES + BATCH_INDEX_BYTES)
    activations = rows * kept.at(row_length, queries, own)
    # before the step: the features' argmax, one chunk of the target's logits at a time (in the head's dtype, the
    # compute one); in it, the larger of the mask's construction (comparisons over [Q, L + Q] and the bias, early in
    # the forward) and, once everything is kept, the logits' gradient and their softmax's (fp32) in the backward
    chunk_rows = max(1, LOGIT_CHUNK_ELEMENTS // cfg.vocab_size)
    features = min(rows * held, chunk_rows) * cfg.vocab_size * act + rows * held * TARGET_BYTES
    in_step = rows * max(queries * (row_length + queries) * (4 + act), 2 * queries * cfg.vocab_size * 4)
    transient = max(features - activations, in_step)
    # context parallel: every layer's keys and values of the whole row, gathered (and this rank's, stacked for it)
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kept.key_value_element
    gathered = 0 if context_parallel == 1 else rows * (row_length + own) * kv
    per_token = activations / (rows * own)
    return StepMemory(weights, batch, activations, transient, per_token, gathered, context_parallel=context_parallel)

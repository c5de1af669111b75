"""The memory of one EAGLE-3 training step at a given row length: what `plan` and the train pre-flight compare with
a GPU's memory, so that a row length that cannot fit is refused before the run, with its remedy.

A step holds the drafter's weights, gradients and AdamW moments, the row's features and target distribution, the
activations TTT keeps for backward, and the largest transient of the step. The activations grow linearly in the row's
tokens (no L x L matrix: benchmarks/results/training-step.md, "Memory of one extra TTT step"); their bytes per token
depend on the drafter's widths, its flags and the implementation. Rather than a hand-written count that drifts from
the code, they are measured from it: ``ttt_loss`` runs on two short rows of small drafters of the same family, flags
and head widths, and every storage its ops make that is still alive when it returns is what the step keeps for
backward (saved for autograd, or held by a checkpointed step's closure: its step-0 keys, its index tensors). Since
every kept tensor is [rows, width] for one of the layer's widths (hidden, intermediate, target hidden, head counts,
latent ranks), the slope per token of one drafter per width, doubled, gives the bytes per token at any width. This
costs a fraction of a second once per shape. A drafter with several decoder layers is calibrated with as many: each
keeps its own activations and step-0 keys, so the slope grows with them. ``benchmarks/train_memory.py`` checks the result against the measured
peak of real steps.

The peak comes in one of two phases (their temporaries are never alive together). In the forward, at the head
loss: everything kept, the row's target softmax, the normed head rows and one chunk's [rows, Vd] temporaries (their
count measured on the divergence's own code). In backward, the target softmax is gone (``ttt_loss`` returned);
checkpointed, a recomputed step and the reference attention's score blocks come on top of what is kept, plain the
head rows' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import torch

from eaglekit.config import TTTConfig
from eaglekit.divergences import DEFAULT_DIVERGENCE, DIVERGENCES, Divergence
from eaglekit.drafters.eagle3.fused import StepKernels
from eaglekit.drafters.eagle3.head_loss import CHUNK_ELEMENTS, CHUNK_ELEMENTS_DEFAULT, head_loss_chunk
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import BLOCK_ELEMENTS, BLOCK_ROWS, ttt_loss
from eaglekit.training.memory import StepMemory, Storages, weight_bytes

# The widths a calibration drafter scales, those of them the drafter's layer has (a Llama layer its K/V heads, a
# latent-attention layer its q and kv ranks; q_lora_rank None is a layer without one); head widths stay the real
# ones (every kept tensor is linear in these with the head widths and the query heads per K/V head fixed).
BASE = {"hidden_size": 64, "intermediate_size": 64, "target_hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "q_lora_rank": 32, "kv_lora_rank": 32}  # fmt: skip
ROWS = (96, 192)  # two row lengths: their difference is the per-token slope, free of per-step constants
HEAD_GRADIENTS = 3  # plain backward's start: dL/dx of the head rows, then the final norm's two [rows, H] gradients
SCORE_BLOCKS = 2  # _PrefixAttention's backward holds a block's probabilities and their gradient (float32) at once


def _query_groups(cfg: DrafterConfig) -> int | None:
    """Query heads per key/value head, when the layer has both and they divide: the calibration keeps it, since
    what attention keeps is not linear in the two counts apart (with one group, repeat_kv copies nothing)."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return heads // kv if heads is not None and kv and heads % kv == 0 else None


def _calibration_config(cfg: DrafterConfig, steps: int, **widths: int) -> DrafterConfig:
    fields: dict[str, Any] = {name: width for name, width in BASE.items() if getattr(cfg, name) is not None} | widths
    groups = _query_groups(cfg)
    if groups is not None:  # the query heads follow the key/value heads at the drafter's own ratio
        fields["num_attention_heads"] = groups * fields["num_key_value_heads"]
    # a window inside the calibration rows (so it is exercised) and longer than the TTT chain (as ttt_loss needs)
    window = None if cfg.sliding_window is None else min(cfg.sliding_window, max(ROWS[0] // 2, steps + 1))
    return dataclasses.replace(
        cfg, vocab_size=64, draft_vocab_size=64, aux_layer_ids=None, sliding_window=window, **fields
    )


def random_row(cfg: DrafterConfig, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """One row of ttt_loss's inputs for ``cfg`` (aux features, ids, target logits, loss mask), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, rows, 3 * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=g)
    logits = torch.randn(1, rows, cfg.draft_vocab_size, generator=g)
    return aux, ids, logits, torch.ones_like(ids)


def _kept_bytes(cfg: DrafterConfig, rows: int, steps: int, checkpoint: bool, bf16: bool) -> int:
    """Bytes ttt_loss keeps for backward on one row of ``rows`` tokens (parameters and inputs not counted): the
    storages it made that are alive when it returns (whoever holds them: autograd, a checkpoint's closure)."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    aux, ids, logits, mask = random_row(cfg, rows, seed=0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with Storages() as made, autocast:
        out = ttt_loss(drafter, aux, ids, logits, mask, settings=TTTConfig(steps=steps),
                       kernels=StepKernels(checkpoint_steps=checkpoint))  # fmt: skip
    kept = made.alive()
    del out
    return kept


def head_chunk_temporaries(loss: Divergence = DEFAULT_DIVERGENCE) -> float:
    """How many [rows, Vd] float32 tensors one chunk of the head loss has alive at its peak (logits, the targets'
    rows, the divergence's own, dL/dlogits), measured on ``head_loss_chunk`` with ``loss``."""
    return _chunk_temporaries(loss.model_dump_json())


@functools.lru_cache(maxsize=16)
def _chunk_temporaries(loss_json: str) -> float:
    fields = json.loads(loss_json)
    loss = DIVERGENCES[fields["name"]](**fields)
    rows, vocab, hidden = 64, 512, 16
    g = torch.Generator().manual_seed(0)
    xc, weight = torch.randn(rows, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    p = torch.softmax(torch.randn(rows, vocab, generator=g), dim=-1)
    argmax, slots, row_weight = p.argmax(-1), torch.arange(rows), torch.ones(rows)
    with Storages(peak=True) as made:
        head_loss_chunk(xc, weight, p, argmax, slots, row_weight, True, loss)
    return made.peak / (rows * vocab * 4)


def kept_bytes_per_token(cfg: DrafterConfig, steps: int, checkpoint: bool, bf16: bool) -> float:
    """The activation bytes a TTT step of ``steps`` keeps per token of the row, at ``cfg``'s widths."""
    return _kept_per_token(json.dumps(dataclasses.asdict(cfg), sort_keys=True), steps, checkpoint, bf16)


@functools.lru_cache(maxsize=64)
def _kept_per_token(cfg_json: str, steps: int, checkpoint: bool, bf16: bool) -> float:
    cfg = DrafterConfig.from_dict(json.loads(cfg_json))

    def slope(c: DrafterConfig) -> float:
        short, long = (_kept_bytes(c, n, steps, checkpoint, bf16) for n in ROWS)
        return (long - short) / (ROWS[1] - ROWS[0])

    base = _calibration_config(cfg, steps)
    at_base = slope(base)
    total = at_base
    for name in BASE:
        if getattr(base, name) is None or (name == "num_attention_heads" and _query_groups(cfg) is not None):
            continue  # absent from the layer, or scaled with the key/value heads
        doubled = slope(_calibration_config(cfg, steps, **{name: 2 * getattr(base, name)}))
        per_unit = (doubled - at_base) / getattr(base, name)
        total += per_unit * (getattr(cfg, name) - getattr(base, name))
    return max(total, 0.0)


def step_memory(
    cfg: DrafterConfig,
    row_tokens: int,
    steps: int,
    *,
    trainable: int,
    frozen: int,
    checkpoint: bool = False,
    bf16: bool = True,
    device_type: str = "cuda",
    context_parallel: int = 1,
    loss: Divergence = DEFAULT_DIVERGENCE,
) -> StepMemory:
    """The memory of one step on rows of ``row_tokens`` tokens (a micro-batch's tokens on this GPU), for a drafter
    with ``trainable`` and ``frozen`` parameters; ``bf16``: autocast as on a GPU (train.dtype auto), else fp32;
    ``loss``: the divergence (train.ttt.loss), whose chunk temporaries the head loss holds.

    ``context_parallel`` ranks splitting the rows (training/context_parallel.py): one rank's memory. It keeps the
    activations of its share of the tokens, holds the features of its share and a halo of ``steps`` target rows,
    and keeps the whole row's step-0 keys and values (the all-gather's output, read by every draft step)."""
    act = 2 if bf16 else 4
    per_token = kept_bytes_per_token(cfg, steps, checkpoint, bf16)
    own = math.ceil(row_tokens / context_parallel)
    heavy = own if context_parallel == 1 else min(own + steps, row_tokens)  # features and targets: share and halo
    weights = weight_bytes(trainable, frozen, bf16=bf16, looked_up=cfg.vocab_size * cfg.hidden_size)  # the embedding
    # the row's aux states and final state (the storage dtype), its target logits over the draft vocabulary and their
    # fp32 softmax (made inside ttt_loss: freed when it returns, before backward)
    softmax = heavy * cfg.draft_vocab_size * 4
    batch = heavy * (4 * cfg.target_hidden_size * act + cfg.draft_vocab_size * act) + softmax
    # forward, at the head loss: the normed rows of every step (float32: RMSNorm scales by its float32 weight) and
    # one chunk's [rows, Vd] float32 temporaries
    head_rows = steps * own
    chunk_rows = max(1, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS_DEFAULT) // cfg.draft_vocab_size)
    chunk = min(chunk_rows, head_rows) * cfg.draft_vocab_size
    forward = 4 * head_rows * cfg.hidden_size + int(head_chunk_temporaries(loss) * 4 * chunk)
    # backward, checkpointed: one TTT step's activations over the row, recomputed, and the reference attention's
    # float32 score blocks (the fused GPU kernel holds none: an upper bound). Plain, nothing is recomputed and each
    # step's gradients come as its kept tensors go: the most is at the start, the head's gradient over its rows and
    # the final norm's backward (the gradient of its scaled rows, and of its input), float32 like the normed rows
    block = min(BLOCK_ELEMENTS, BLOCK_ROWS * row_tokens * cfg.num_attention_heads)
    others = row_tokens - own  # positions of the other ranks, whose step-0 keys and values this rank holds
    kv = key_value_elements(cfg)
    # every TTT step's span attention keeps a float32 copy of the keys and values it reads (the whole row's): on one
    # GPU that is in per_token; under context parallelism the other ranks' part comes on top. Checkpointed, only
    # the gathered keys stay (the copies are made again in backward, one step at a time: transient)
    copies = 0 if checkpoint else steps
    if checkpoint:
        one_step = kept_bytes_per_token(cfg, 1, False, bf16) * own + others * kv * 4
        backward = int(one_step + SCORE_BLOCKS * 4 * block) - softmax
    else:
        backward = HEAD_GRADIENTS * 4 * head_rows * cfg.hidden_size - softmax
    gathered = others * kv * (act + 4 * copies)
    return StepMemory(
        weights,
        batch,
        int(per_token * own),
        max(forward, backward, 0),
        per_token,
        gathered,
        context_parallel=context_parallel,
    )


def key_value_elements(cfg: DrafterConfig) -> int:
    """Elements of one position's step-0 keys and values, as the layers make them (MLA: per head, decompressed),
    every decoder layer's (each attends its own)."""
    return cfg.layer.key_value_elements(cfg) * cfg.num_layers

"""The DSpark block drafter: DFlash's parallel backbone plus a Markov head that makes the block semi-autoregressive.

Read from vLLM 0.32 (``model_executor/models/qwen3_dspark.py``, ``v1/worker/gpu/spec_decode/dspark/speculator.py``)
and speculators 0.9.0 (``models/dspark``). What DSpark keeps of DFlash (``model/dflash.py``) is the whole backbone:
the context projection ``fc`` + ``hidden_norm``, the Qwen3-style non-causal layers whose keys/values read the
context, the target's frozen embedding and head. What it changes:

- the block layout ("anchor sampling", vLLM's and speculators' DSpark default ``sample_from_anchor: true``): a round
  drafting K tokens builds K queries ``[last emitted token, mask × (K-1)]`` at positions n..n+K-1, and *every*
  query predicts the next token, the anchor included (query n+i proposes the token at n+i+1). DFlash builds K+1
  queries and drafts only at the K masks.
- a Markov head, a low-rank first-order transition bias over the vocabulary:

      logits_i = lm_head(norm(h_i)) + markov_w2(markov_w1[prev_i])        markov_w1 [V, r], markov_w2 [V, r]

  where prev_i is the token at query i's own position: the anchor for i = 0, then the token drafted at step i-1.
  Serving samples the block left to right (the backbone runs once, only the bias is sequential), so each draft
  conditions on the one before it; training teacher-forces prev_i with the sequence's own tokens.

The exported weights are DFlash's plus ``markov_head.markov_w1.weight`` and ``markov_head.markov_w2.weight``
(``dspark_checkpoint.py``). speculators' optional confidence head (an acceptance estimate that only vLLM's
adaptive verification reads) is not trained here: vLLM drops it when a checkpoint has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eaglekit.config import DSparkDraft, RunConfig
from eaglekit.drafters.dflash import model as dflash
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import UsageError

DEFAULT_MARKOV_RANK = 256  # speculators 0.9.0's DSparkSpeculatorConfig.markov_rank


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = DEFAULT_MARKOV_RANK  # r of the transition bias markov_w2 @ markov_w1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 1:
            raise UsageError(
                f"dspark: 'markov_rank' must be a positive integer, got {self.markov_rank!r}",
                "fix train.draft.markov_rank (speculators' default is 256)",
            )


def config_for_run(cfg: RunConfig, hf_config: Any, aux_layer_ids: list[int], vocab_size: int) -> DSparkConfig:
    """The DSpark drafter a run's ``train.draft`` asks for: DFlash's backbone options, and the Markov rank."""
    backbone = dflash.config_for_run(cfg, hf_config, aux_layer_ids, vocab_size)
    return DSparkConfig(
        **backbone.to_dict(), markov_rank=cfg.train.draft_as(DSparkDraft).markov_rank or DEFAULT_MARKOV_RANK
    )


class MarkovHead(nn.Module):
    """The low-rank transition bias (vLLM's ``DSparkMarkovHead``, speculators' ``MarkovHead`` type vanilla)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' init: the bias starts near zero
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] -> the bias [..., V] (fp32, or fp64 in fp64) added to the logits of the query at the same
        position."""
        return dflash.at_least_fp32(self.markov_w2(self.markov_w1(prev_ids)))


class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone (``forward`` gives the base logits of every query) and the Markov head."""

    family = "dspark"
    first_drafting_slot = 0  # anchor sampling: the anchor slot predicts the next token
    config: DSparkConfig

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)

    def slot_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head(prev_ids)

    @torch.no_grad()
    def draft_block(self, base_logits: torch.Tensor, anchor: int) -> list[int]:
        """base_logits [K, V] of one round's K queries -> the K drafts, sampled left to right as vLLM's
        ``DSparkSpeculator._sample_sequential`` does at temperature 0."""
        prev = torch.tensor(anchor, device=base_logits.device)
        drafts = []
        for logits in base_logits:
            prev = (logits + self.markov_head(prev)).argmax(-1)
            drafts.append(int(prev))
        return drafts

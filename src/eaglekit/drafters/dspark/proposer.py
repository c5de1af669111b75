"""DSpark's proposer: DFlash's block proposer (``drafters/dflash/proposer.py``) with the Markov head's drafting.

A DSpark drafter (``drafters/dspark/model.py``) is proposed for as vLLM 0.32's ``DSparkSpeculator`` does it
(``v1/worker/gpu/spec_decode/dspark/speculator.py``, anchor sampling): the same cached context, K queries
``[last emitted token, mask × (K-1)]`` at positions n..n+K-1, every query drafting (query n+i proposes the token at
n+i+1), sampled left to right with the Markov bias of the previous draft (the last emitted token for the first).
"""

from __future__ import annotations

import torch

from eaglekit.drafters.dflash.proposer import BlockProposer
from eaglekit.drafters.dspark.model import DSparkDrafter


class DSparkProposer(BlockProposer):
    """Block drafting from the anchor with the Markov head's left-to-right sampling (module docstring)."""

    drafter: DSparkDrafter

    @torch.no_grad()
    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        return self.drafter.draft_block(
            self.block_logits([self.last] + [self.mask_token_id] * (k - 1)), self.last
        ), None

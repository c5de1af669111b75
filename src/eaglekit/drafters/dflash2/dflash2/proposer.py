"""DFlash2's proposer: DFlash's block proposer (``drafters/dflash/proposer.py``) with the path selector's walk.

A round is DFlash's (queries ``[last emitted token, mask × K]`` at positions n..n+K, the mask slots drafting), then
the drafts are the selector's greedy path over each slot's top K candidates (``DFlash2Drafter.draft_path``), as
vLLM 0.32's V2 runner drafts at temperature 0 (``v1/worker/gpu/spec_decode/dflash2/speculator.py``). Without the
selector (``selector=False``) it drafts each slot's argmax: what an engine that ignores the selector serves
(``checkpoint.FALLBACK``), so evaluate can say what that fallback costs.
"""

from __future__ import annotations

import torch

from eaglekit.drafters.dflash.proposer import BlockProposer
from eaglekit.drafters.dflash2.model import DFlash2Drafter


class DFlash2Proposer(BlockProposer):
    drafter: DFlash2Drafter

    def __init__(self, drafter: DFlash2Drafter, selector: bool = True):
        super().__init__(drafter)
        self.selector = selector

    @torch.no_grad()
    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        hidden = self.block_hidden([self.last] + [self.mask_token_id] * k)[1:]
        logits = self.drafter.logits(hidden)
        if not self.selector:
            return logits.argmax(-1).tolist(), None
        return self.drafter.draft_path(logits, hidden, self.last), None

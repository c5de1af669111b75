"""The P-EAGLE drafter: EAGLE-3's one decoder layer drafting all K tokens in one forward pass.

It is the EAGLE-3 drafter (``drafters/eagle3/model.py``) plus one learned vector, ``mask_hidden`` [3*Ht], that stands
in for the target's aux hidden states at the K-1 positions the target has not produced yet, and a slot token that
stands in for their unknown tokens. As vLLM 0.32 serves it (``llm_base_proposer.py: _init_parallel_drafting_params``,
``set_inputs_first_pass``; ``llama_eagle3.py``): after the verified positions, the query holds the bonus position p
(the last target state with the token just sampled) and K-1 slots at positions p+1..p+K-1, each the slot token with
the feature ``fc(fc_norm(mask_hidden))`` (``combine_hidden_states``, the projection real states get), in one causal
pass; draft i is the argmax at position p+i. No draft feeds another: a slot never sees an earlier slot's draft, only
its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.errors import UsageError


@dataclass
class PEagleConfig(DrafterConfig):
    """An EAGLE-3 drafter config (Llama layer) and the token its parallel slots hold."""

    mask_token_id: int = 0  # the slot token: vLLM reads it as pard_token (plain form) or mask_token_id (speculators)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.architecture != "llama":
            raise UsageError(
                f"drafter config: a P-EAGLE drafter has a Llama layer, not {self.architecture}",
                "vLLM serves parallel drafting with llama_eagle3.py only; use train.draft.architecture: peagle",
            )
        if isinstance(self.mask_token_id, bool) or not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise UsageError(
                f"drafter config: mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                f"[0, {self.vocab_size})",
                "set train.draft.mask_token_id to a token id of the target (a pad or unused token)",
            )

    def extra_weights(self) -> dict[str, tuple[int, ...]]:
        return {"mask_hidden": (1, 1, 3 * self.target_hidden_size)}


class PEagleDrafter(Eagle3Drafter):
    """``Eagle3Drafter`` with the parallel slots' learned feature."""

    config: PEagleConfig

    def __init__(self, cfg: PEagleConfig):
        super().__init__(cfg)
        # speculators' and SpecForge's shape and start (randn): the key vLLM loads with .view(1, -1)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * cfg.target_hidden_size))

    def slot_feature(self, n: int) -> torch.Tensor:
        """The feature of ``n`` parallel slots [n, H]: mask_hidden through the same norms and fc as target states."""
        return self.fuse(self.mask_hidden.view(1, -1).to(self.fc.weight.dtype)).expand(n, -1)

    def slot_ids(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.full((n,), int(self.config.mask_token_id), dtype=torch.long, device=device)

    def draft_step_input(self, previous: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training's draft step d of every chain is slot d: the slot token and mask_hidden's feature, whatever the
        previous step made (only its keys are seen, through the attention)."""
        n = previous.shape[0]
        with torch.no_grad():
            embeds = self.embed_tokens(self.slot_ids(n, previous.device))
        return embeds, self.slot_feature(n).to(previous.dtype)

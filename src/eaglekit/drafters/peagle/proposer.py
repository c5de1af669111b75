"""P-EAGLE's proposer for ``speculative/decode.generate``: all K drafts from one drafter forward, as vLLM drafts them.

The positions the target verified since the last round go in with their target states (position t: the state at t
and the token at t+1), followed by K-1 slots (the slot token, mask_hidden's feature) at the next K-1 positions, in
one causal pass over the drafter's KV cache; draft i is the argmax at the last verified position + i. The slots'
keys leave the cache after the pass (vLLM overwrites them with the verified tokens' the next round).
"""

from __future__ import annotations

import torch

from eaglekit.drafters.eagle3.proposer import EagleProposer


class ParallelProposer(EagleProposer):
    """``EagleProposer``'s cache and bookkeeping; the K drafts come from one forward instead of a chain of K."""

    @torch.no_grad()
    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        drafter = self.drafter
        start, n = self.real_length, len(self.pending_ids)
        slots = max(k - 1, 0)
        aux = torch.cat([a for a in self.pending_aux if a is not None])
        real = drafter.fuse(aux[None].to(self.device, self.dtype))
        hidden = torch.cat([real, drafter.slot_feature(slots)[None].to(real.dtype)], dim=1)
        ids = torch.cat([torch.tensor(self.pending_ids, device=self.device), drafter.slot_ids(slots, self.device)])
        positions = torch.arange(start, start + n + slots, device=self.device)[None]
        logits, _ = drafter(ids[None], hidden, positions, self.cache)
        self.cache.crop(start + n)  # the slots' keys are not the verified tokens'
        self.real_length = start + n
        self.pending_ids, self.pending_aux = [], []
        drafts, qs = [], []
        for row in logits[0, n - 1 : n - 1 + k]:
            token, q = self._draft(row, temperature, generator)
            drafts.append(token)
            qs.append(q)
        sampled = [q for q in qs if q is not None]
        return drafts, (torch.stack(sampled) if sampled and len(sampled) == len(qs) else None)

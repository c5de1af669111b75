"""EAGLE-3's proposer for ``speculative/decode.generate``: chain drafting with an ``Eagle3Drafter`` and its own KV cache.

It follows vLLM's proposer: position t of the drafter takes the fused target feature
at t with the token at t+1 (RoPE position t); the first draft comes from the last such position, and
each further draft feeds the drafter's own pre-norm hidden output and the previous draft at position+1.
"""

from __future__ import annotations

import torch

from eaglekit.drafters.eagle3.model import DraftKVCache


class EagleProposer:
    """Chain drafting with an ``Eagle3Drafter`` and its own KV cache.

    ``sample_drafts=False`` drafts the argmax and verifies it as a point mass, as vLLM and SGLang do;
    True samples drafts from the drafter's distribution (mapped to the target vocab via d2t) and
    verifies with min(1, p/q), as the EAGLE reference does.
    """

    def __init__(self, drafter, aux_layer_ids: list[int] | None = None, sample_drafts: bool = False):
        self.drafter = drafter.eval()
        aux_layer_ids = aux_layer_ids or drafter.config.aux_layer_ids
        if not aux_layer_ids:
            raise ValueError("the drafter's config has no aux_layer_ids: pass the target's ([2, N//2, N-3] by default)")
        self.aux_layer_ids = list(aux_layer_ids)
        self.sample_drafts = sample_drafts
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.target_vocab = drafter.t2d.shape[0]
        self.to_target = drafter.draft_to_target(torch.arange(drafter.d2t.shape[0], device=self.device)).cpu()

    def reset(self, ids: list[int], aux: torch.Tensor | None) -> None:
        self.cache = DraftKVCache()
        self.real_length = 0  # cache entries made from target states; the rest are self-fed drafts
        self.pending_ids, self.pending_aux = list(ids[1:]), [aux]  # (state at t, token t+1) pairs not yet drafted from

    def update(self, new_ids: list[int], aux: torch.Tensor | None) -> None:
        # The target's states replace the self-fed draft positions. Pairs a round did not consume (it
        # drafted nothing) stay pending.
        self.cache.crop(self.real_length)
        self.pending_ids += list(new_ids)
        self.pending_aux.append(aux)

    @torch.no_grad()
    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        start, n = self.real_length, len(self.pending_ids)
        ids = torch.tensor([self.pending_ids], device=self.device)
        # the EAGLE proposer always runs with target states (aux_layer_ids is set), so no pending entry is None
        aux = torch.cat([a for a in self.pending_aux if a is not None])
        hidden = self.drafter.fuse(aux[None].to(self.device, self.dtype))
        positions = torch.arange(start, start + n, device=self.device)[None]
        logits, hidden = self.drafter(ids, hidden, positions, self.cache)
        self.real_length = start + n
        self.pending_ids, self.pending_aux = [], []

        drafts, qs = [], []
        for step in range(k):
            token, q = self._draft(logits[0, -1], temperature, generator)
            drafts.append(token)
            qs.append(q)
            if step + 1 < k:
                logits, hidden = self.drafter(
                    torch.tensor([[token]], device=self.device),
                    hidden[:, -1:],
                    torch.tensor([[start + n + step]], device=self.device),
                    self.cache,
                )
        sampled = [q for q in qs if q is not None]
        return drafts, (torch.stack(sampled) if sampled and len(sampled) == len(qs) else None)

    def _draft(self, logits: torch.Tensor, temperature: float, generator) -> tuple[int, torch.Tensor | None]:
        if not self.sample_drafts or temperature <= 0:
            return int(self.to_target[int(logits.argmax())]), None
        q_draft = torch.softmax(logits.float().cpu() / temperature, -1)
        draft = int(torch.multinomial(q_draft, 1, generator=generator))
        q = torch.zeros(self.target_vocab).index_put_((self.to_target,), q_draft)
        return int(self.to_target[draft]), q

"""Block drafting with a DFlash drafter, as vLLM 0.32's ``DFlashProposer`` does it (``v1/spec_decode/dflash.py``).

A round drafts K tokens in one forward pass of the drafter (``speculative.decode.generate`` then verifies them
with the target, keeps the accepted prefix and the bonus token, exactly as for EAGLE-3 and n-gram):

- context: the target's aux states of every token verified so far, at their positions 0..n-1. vLLM projects
  them into the drafter's KV cache once (``precompute_and_store_context_kv``); here they are kept per layer too.
- queries: ``[last emitted token, mask × K]`` at positions n..n+K (``copy_and_expand_dflash_inputs_kernel``),
  non-causal: each query sees the whole context and all K+1 queries.
- drafts: the argmax of the logits at the K mask slots (``token_indices_to_sample`` skips the bonus slot). vLLM
  drafts greedily and verifies drafts as point masses (``generate``'s q = None): at T > 0 a draft d is accepted
  with probability p(d), and a rejection resamples from p without d.

A windowed drafter (``sliding_window`` W) keeps only the last W-1 context positions cached: no query of a later
round can see an older one (vLLM's sliding-window KV cache manager frees them too).

K may be smaller than the trained block (block_size - 1 mask slots): vLLM then builds K+1 queries, and so does
this proposer; serving with a K the drafter was not trained at changes what the queries see, and that is what
``evaluate`` measures per K.
"""

from __future__ import annotations

import torch

from eaglekit.drafters.dflash.model import DFlashDrafter


class BlockProposer:
    """The ``speculative.decode.Proposer`` for block drafters."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter.eval()
        self.aux_layer_ids: list[int] | None = list(drafter.config.aux_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.mask_token_id = drafter.config.mask_token_id

    def reset(self, ids: list[int], aux: torch.Tensor | None) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0  # context positions verified
        self.first = 0  # the first of them still cached
        self.last = ids[-1]
        self._extend(aux)

    def update(self, new_ids: list[int], aux: torch.Tensor | None) -> None:
        # aux holds the states of the previous last token and the accepted drafts: exactly the new context
        self.last = new_ids[-1]
        self._extend(aux)

    @torch.no_grad()
    def _extend(self, aux: torch.Tensor | None) -> None:
        if aux is None or aux.shape[0] == 0:
            return
        positions = torch.arange(self.length, self.length + aux.shape[0], device=self.device)[None]
        kv = self.drafter.context_kv(self.drafter.context(aux[None].to(self.device, self.dtype)), positions)
        if self.kv is None:
            self.kv = kv
        else:
            pairs = zip(self.kv, kv, strict=True)
            self.kv = [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1)) for (k0, v0), (k1, v1) in pairs]
        self.length += aux.shape[0]
        window = self.drafter.config.sliding_window
        drop = self.length - self.first - (window - 1) if window is not None else 0
        if drop > 0:
            self.kv = [(k[:, drop:], v[:, drop:]) for k, v in self.kv]
            self.first += drop

    @torch.no_grad()
    def block_logits(self, ids: list[int]) -> torch.Tensor:
        """The drafter's logits [Q, V] for the queries ``ids`` at positions n, n+1, ... after the cached context."""
        return self.drafter.logits(self.block_hidden(ids))

    @torch.no_grad()
    def block_hidden(self, ids: list[int]) -> torch.Tensor:
        """The drafter's normed hidden states [Q, H] for the queries ``ids`` (``block_logits``)."""
        assert self.kv is not None, "reset() first"
        query = torch.tensor([ids], device=self.device)
        positions = torch.arange(self.length, self.length + len(ids), device=self.device)[None]
        context = torch.arange(self.first, self.length, device=self.device)[None]
        return self.drafter.final_hidden(query, positions, self.kv, context_positions=context)[0]

    @torch.no_grad()
    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        logits = self.block_logits([self.last] + [self.mask_token_id] * k)
        return logits[1:].argmax(-1).tolist(), None

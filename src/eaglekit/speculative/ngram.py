"""The n-gram (prompt lookup) proposer: the baseline that needs no model, as vLLM's ``ngram`` method.

Drafts are the tokens that followed an earlier occurrence of the context's own suffix. The match rule
is vLLM's (``vllm/v1/spec_decode/ngram_proposer.py``): the longest suffix of length ``n_max`` down to
``n_min`` that occurs earlier in prompt + output, at its *earliest* occurrence, and up to ``k`` tokens
after it (fewer when the context ends first). The proposals are deterministic, so verification treats
them as a point mass (q = one-hot), as vLLM's rejection sampler does for ``ngram``.
"""

from __future__ import annotations

import torch


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier match of the longest matching suffix; [] if none."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n :]
        # occurrences may overlap the suffix but must end before the last token, so one token at least follows
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer:
    """The ``Proposer`` of ``speculative.decode`` for prompt lookup."""

    aux_layer_ids = None  # needs no hidden states from the target

    def __init__(self, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []

    def reset(self, ids: list[int], aux: torch.Tensor | None) -> None:
        self.tokens = list(ids)

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> tuple[list[int], None]:
        return ngram_propose(self.tokens, k, self.n_min, self.n_max), None

    def update(self, new_ids: list[int], aux: torch.Tensor | None) -> None:
        self.tokens.extend(new_ids)

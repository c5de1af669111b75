"""The draft vocabulary's mapping onto the target's: the buffers every drafter with a reduced head carries."""

from __future__ import annotations

import torch

from eaglekit.errors import UsageError


def build_d2t_t2d(selected_target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary mapping buffers for draft vocab = ``selected_target_ids`` (sorted, unique).

    d2t[i] = selected[i] - i (so target = draft + d2t[draft]); t2d[j] is True for selected target ids.
    """
    ids = torch.as_tensor(selected_target_ids).to(torch.long).cpu()
    if ids.dim() != 1 or ids.numel() == 0:
        raise UsageError(
            f"selected target ids must be a non-empty 1-D tensor, got shape {list(ids.shape)}",
            "pass the sorted target token ids of the draft vocabulary",
        )
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise UsageError(
            f"selected target ids must lie in 0..{vocab_size - 1}, got {ids.min().item()}..{ids.max().item()}",
            "the draft vocabulary was built for another tokenizer; rerun the vocab stage",
        )
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise UsageError("selected target ids must be sorted and unique", "sort them (torch.unique does both)")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d

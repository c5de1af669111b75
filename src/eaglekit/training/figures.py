"""The figures a training step reports, whatever its objective, and the acceptance length they simulate."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepFigures:
    """What an objective's step returns besides its loss: the per-position figures the loop logs, sums over a
    window and turns into simulated τ (EAGLE-3's per TTT step, a block drafter's per block slot)."""

    loss: torch.Tensor  # scalar, sum_k w_k * (summed loss of step k) / normalizer(count_k)
    loss_k: list[
        float
    ]  # per step: mean loss (soft cross-entropy for kl_div) over this batch's counted positions (0.0 where none)
    acc_k: list[float]  # per step: share of counted positions where draft argmax == target argmax
    count_k: list[int]  # per step: counted positions
    anchor: float = 0.0  # ||θ - θ0||² when the training loop pulls toward starting weights (train.ttt.anchor_weight)


def simulated_acceptance_length(acc_k: list[float]) -> float:
    """Tokens per verification pass if draft k is accepted with probability acc_k[k]: 1 + sum_k prod_{j<=k} acc_j."""
    total, run = 1.0, 1.0
    for acc in acc_k:
        run *= acc
        total += run
    return total

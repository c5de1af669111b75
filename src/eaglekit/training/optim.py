"""The optimizer and its learning-rate schedule (one place, so a run's recipe is read in one file)."""

from __future__ import annotations

import math

import torch
from torch import nn

from eaglekit.config import TrainConfig


def build_optimizer(tc: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the EAGLE reference betas (0.9, 0.95) over the trainable parameters."""
    return torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)


def build_scheduler(
    tc: TrainConfig, optim: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: lr_factor(s, tc.warmup_steps, total_steps, tc.min_lr_ratio)
    )


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine from 1 down to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

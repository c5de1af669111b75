"""The optimizer and its learning-rate schedule (one place, so a run's recipe is read in one file)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eaglekit.config import TrainConfig
from eaglekit.errors import UsageError
from eaglekit.training import distributed as dist

# 2-D weights that stay with AdamW under Muon: vocabulary-sized embeddings and heads (Keller Jordan's convention,
# and speculators' list for the EAGLE-3 drafter)
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")


def build_optimizer(tc: TrainConfig, named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW over the trainable parameters, or Muon on the 2-D weights and AdamW on the rest.

    Muon is ``torch.optim.Muon`` as speculators configures it (momentum 0.95, Nesterov, 5 Newton–Schulz steps,
    ``adjust_lr_fn="match_rms_adamw"`` so one learning rate and schedule serve both groups).
    """
    if tc.optimizer == "adamw":
        return torch.optim.AdamW(
            [p for _, p in named_params], lr=tc.lr, betas=tc.adam_betas, weight_decay=tc.weight_decay
        )
    if dist.active() and tc.distributed == "fsdp":
        raise UsageError(
            "train.optimizer muon is not supported with train.distributed fsdp (its sharded optimizer state "
            "is saved through torch's single-optimizer API)",
            "use train.distributed ddp, or train.optimizer adamw",
        )
    matrices = [p for name, p in named_params if is_muon_weight(name, p)]
    others = [p for name, p in named_params if not is_muon_weight(name, p)]
    parts: list[torch.optim.Optimizer] = []
    if matrices:
        parts.append(
            torch.optim.Muon(
                matrices,
                lr=tc.lr,
                weight_decay=tc.muon_weight_decay,
                momentum=0.95,
                nesterov=True,
                ns_steps=5,
                adjust_lr_fn="match_rms_adamw",
            )
        )
    if others:
        parts.append(torch.optim.AdamW(others, lr=tc.lr, betas=tc.adam_betas, weight_decay=tc.weight_decay))
    return Together(parts)


def is_muon_weight(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAME_HINTS)


class Together(torch.optim.Optimizer):
    """Several optimizers stepped as one, so the schedule, gradient clipping and checkpoints see one optimizer.

    ``param_groups`` are the parts' own group dicts: the scheduler's learning rate lands in each part.
    """

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        params = [p for part in parts for group in part.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.param_groups = [group for part in parts for group in part.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("parts")
        if saved is None or len(saved) != len(self.parts):
            raise UsageError(
                "the checkpoint's optimizer state is not this run's train.optimizer (muon)",
                "resume with the optimizer the run started with, or start a new run directory",
            )
        for part, state in zip(self.parts, saved, strict=True):
            part.load_state_dict(state)
        # loading replaces each part's group dicts: point at the new ones, or the schedule would set a stale copy
        self.param_groups = [group for part in self.parts for group in part.param_groups]


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

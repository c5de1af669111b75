"""The per-step objective the training loop calls: EAGLE-3's training-time test as a module.

The loop knows nothing of TTT: it calls ``objective(*inputs) -> (loss, figures)`` and steps the optimizer. A drafter
family with another objective (a block drafter, say) supplies its own module with the same call.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from eaglekit.config import TrainConfig
from eaglekit.model.drafter import Eagle3Drafter
from eaglekit.training import distributed as dist
from eaglekit.training.fused import REFERENCE, StepKernels
from eaglekit.training.ttt import ttt_loss


class TTT(nn.Module):
    """ttt_loss as a module's forward, so DDP / FSDP see a forward pass (their gradient sync hooks onto it).

    Under torchrun the loss of each TTT step is the sum over every rank's counted positions divided by their
    global count (``train.loss_normalization: sequence``: the sum of each document's mean over every rank's
    documents, divided by their global number): each rank divides its own sum by the all-reduced count and
    multiplies by the world size, which the gradient averaging of DDP / FSDP divides out again. So ranks holding fewer counted positions
    weigh less, as they would in one process on the whole batch.

    ``anchor_weight`` > 0 adds the L2-SP pull toward the starting weights (Li et al. 2018):
    anchor_weight / 2 · ||θ - θ0||² over the trainable parameters, θ0 as they are when this module is built.

    The recipe levers (``train.loss``, ``train.step_weights``, ``train.noise``) come in through ``from_config``;
    the noise is added to the target's hidden states in training mode only, so held-out figures see clean features.
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        steps: int,
        decay: float,
        anchor_weight: float = 0.0,
        loss: str = "kl_div",
        lk_eta: float = 3.0,
        step_weights: list[float] | None = None,
        noise: str = "none",
        noise_scale: float = 0.0,
        normalization: str = "token",
        kernels: StepKernels = REFERENCE,
    ):
        super().__init__()
        self.drafter, self.steps, self.decay, self.anchor_weight = drafter, steps, decay, anchor_weight
        self.loss, self.lk_eta, self.noise, self.noise_scale = loss, lk_eta, noise, noise_scale
        self.normalization = normalization
        self.step_weights = list(step_weights) if step_weights is not None else [decay**k for k in range(steps)]
        self.kernels = kernels  # the fused GPU kernels or the reference (training/fused.py)
        # not buffers: FSDP must not shard them, checkpoints must not hold them (they are the init_from weights)
        self.anchor = (
            {name: p.detach().clone() for name, p in drafter.named_parameters() if p.requires_grad}
            if anchor_weight > 0
            else {}
        )

    @classmethod
    def from_config(cls, drafter: Eagle3Drafter, tc: TrainConfig, kernels: StepKernels = REFERENCE) -> TTT:
        return cls(
            drafter, tc.ttt_steps, tc.ttt_decay, tc.anchor_weight, tc.loss, tc.lk_eta, tc.step_weights, tc.noise,
            tc.noise_scale, tc.loss_normalization, kernels,
        )  # fmt: skip

    def forward(self, aux, input_ids, target_logits, loss_mask, attention_mask, target_in_draft, position_ids=None):
        world = dist.world_size() if dist.active() else 1
        if self.training and self.noise != "none" and self.noise_scale > 0:
            aux = aux + feature_noise(aux, self.noise, self.noise_scale)
        out = ttt_loss(
            self.drafter,
            aux,
            input_ids,
            target_logits,
            loss_mask,
            attention_mask,
            self.steps,
            self.decay,
            target_in_draft,
            position_ids=position_ids,
            normalizer=(lambda count: dist.all_reduce_sum(count.clone())) if world > 1 else None,
            loss=self.loss,
            lk_eta=self.lk_eta,
            step_weights=self.step_weights,
            normalization=self.normalization,
            kernels=self.kernels,
        )
        loss = out.loss * world
        if out.count_k[0] == 0:  # nothing counted on this rank: touch every parameter so DDP's reduction completes
            loss = loss + sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        if self.anchor:
            params = dict(self.drafter.named_parameters())
            pull = sum((((params[name] - start) ** 2).sum() for name, start in self.anchor.items()), torch.zeros(()))
            out.anchor = float(pull.detach())
            loss = loss + 0.5 * self.anchor_weight * pull
        return loss, out


def feature_noise(aux: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """Noise for the hidden states: U(-scale, scale) or N(0, scale²), in their dtype, from the global RNG (seeded
    and checkpointed by the loop, so a resumed run draws what an uninterrupted one would)."""
    if kind == "uniform":
        return (torch.rand_like(aux) * 2 - 1) * scale
    if kind == "gaussian":
        return torch.randn_like(aux) * scale
    raise ValueError(f"unknown noise kind {kind!r}; expected none, uniform or gaussian")


def wrap(module: nn.Module, mode: str, device: torch.device) -> nn.Module:
    if not dist.active():
        return module
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One unit: the drafter is one layer, and TTT calls its parts directly rather than through forward().
        return cast(nn.Module, fully_shard(module, reshard_after_forward=False))  # the module, its class extended
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

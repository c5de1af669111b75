"""The per-step objective the training loop calls: EAGLE-3's training-time test as a module.

The loop knows nothing of TTT: it calls ``objective(*inputs) -> (loss, figures)`` and steps the optimizer. A drafter
family with another objective (a block drafter, say) supplies its own module with the same call.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.fused import REFERENCE, StepKernels
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.training import distributed as dist


class TTT(nn.Module):
    """ttt_loss as a module's forward, so DDP / FSDP see a forward pass (their gradient sync hooks onto it).

    Under torchrun the loss of each TTT step is the sum over every rank's counted positions divided by their
    global count (``train.ttt.loss_normalization: sequence``: the sum of each document's mean over every rank's
    documents, divided by their global number): each rank divides its own sum by the all-reduced count and
    multiplies by the world size, which the gradient averaging of DDP / FSDP divides out again. So ranks holding fewer counted positions
    weigh less, as they would in one process on the whole batch.

    ``anchor_weight`` > 0 adds the L2-SP pull toward the starting weights (Li et al. 2018):
    anchor_weight / 2 · ||θ - θ0||² over the trainable parameters, θ0 as they are when this module is built.

    Everything it does besides the batch is ``settings``, the config's ``train.ttt`` (steps and their weights, the
    loss, the noise, the anchor); ``kernels`` are the step's kernels for the device (``training/fused.step_kernels``).
    The noise is added to the target's hidden states in training mode only, so held-out figures see clean features.
    """

    def __init__(self, drafter: Eagle3Drafter, settings: TTTConfig | None = None, kernels: StepKernels = REFERENCE):
        super().__init__()
        settings = TTTConfig() if settings is None else settings  # the config's defaults
        self.drafter, self.settings = drafter, settings
        self.step_weights = list(settings.weights)
        self.kernels = kernels  # the fused GPU kernels or the reference (training/fused.py)
        # not buffers: FSDP must not shard them, checkpoints must not hold them (they are the init_from weights)
        self.anchor = (
            {name: p.detach().clone() for name, p in drafter.named_parameters() if p.requires_grad}
            if settings.anchor_weight > 0
            else {}
        )

    def forward(self, aux, input_ids, target_logits, loss_mask, attention_mask, target_in_draft, position_ids=None):
        world = dist.world_size() if dist.active() else 1
        settings = self.settings
        if self.training and settings.noise != "none" and settings.noise_scale > 0:
            aux = aux + feature_noise(aux, settings.noise, settings.noise_scale)
        out = ttt_loss(
            self.drafter,
            aux,
            input_ids,
            target_logits,
            loss_mask,
            attention_mask,
            target_in_draft=target_in_draft,
            position_ids=position_ids,
            settings=settings,
            kernels=self.kernels,
            normalizer=(lambda count: dist.all_reduce_sum(count.clone())) if world > 1 else None,
        )
        loss = out.loss * world
        if out.count_k[0] == 0:  # nothing counted on this rank: touch every parameter so DDP's reduction completes
            loss = loss + sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        if self.anchor:
            params = dict(self.drafter.named_parameters())
            pull = sum((((params[name] - start) ** 2).sum() for name, start in self.anchor.items()), torch.zeros(()))
            out.anchor = float(pull.detach())
            loss = loss + 0.5 * settings.anchor_weight * pull
        return loss, out


def feature_noise(aux: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """Noise for the hidden states: U(-scale, scale) or N(0, scale²), in their dtype, from the global RNG (seeded
    and checkpointed by the loop, so a resumed run draws what an uninterrupted one would)."""
    if kind == "uniform":
        return (torch.rand_like(aux) * 2 - 1) * scale
    if kind == "gaussian":
        return torch.randn_like(aux) * scale
    raise ValueError(f"unknown noise kind {kind!r}; expected none, uniform or gaussian")

"""``train.ttt``: EAGLE-3's training-time test, its steps and their weights, the loss and the step's kernels."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eaglekit.config.base import NonNegativeFloat, Section
from eaglekit.divergences import KLDiv, LossChoice, loss_reference


class StepWeights(tuple[float, ...]):
    """The loss weight of each TTT step, one per step: their number is the step count."""

    @classmethod
    def decayed(cls, steps: int, decay: float) -> StepWeights:
        """decay^k for k = 0..steps-1 (EAGLE's and SpecForge's weighting): the one place it is computed."""
        return cls(decay**k for k in range(steps))


class TTTConfig(Section):
    """EAGLE-3's training-time test (drafters/eagle3/ttt.py): its steps and their weights, the loss and its levers, the
    step's kernels. A block drafter (dflash, dspark) trains its own objective, which reads none of them."""

    steps: int = Field(7, ge=1, description="draft steps trained per position, each on the drafter's own last output")
    decay: float = Field(0.8, gt=0.0, description="step k's loss weight decay^k, unless step_weights is given")
    step_weights: list[NonNegativeFloat] | None = Field(
        None,
        description="loss weight of each TTT step, one per step (speculators: [1, 1, 1] at 3 steps); "
        "None: decay**k (EAGLE / SpecForge: 0.8**k at 7 steps)",
    )
    loss: LossChoice = Field(
        default_factory=KLDiv,
        description="divergence between the target's and the draft's distributions (eaglekit/divergences.py): a "
        "name, or {name: NAME, PARAMETER: VALUE} for one with parameters. " + loss_reference(),
    )
    loss_normalization: Literal["token", "sequence"] = Field(
        "token",
        description="token: each TTT step's loss is the mean over its counted positions (long sequences weigh "
        "more); sequence: the mean over documents of each document's mean (DeepSpec's remedy). Under DDP both "
        "count every rank's positions / documents",
    )
    noise: Literal["none", "uniform", "gaussian"] = Field(
        "none",
        description="noise added to the target's hidden states (the drafter's input features) in training only, "
        "so the drafter sees features as imperfect as its own later steps; uniform: U(-noise_scale, "
        "noise_scale), gaussian: N(0, noise_scale^2)",
    )
    noise_scale: float = Field(0.05, ge=0.0, description="the noise's half-width (uniform) or standard deviation")
    anchor_weight: float = Field(
        0.0,
        ge=0.0,
        description="L2-SP pull toward the starting weights (train.init_from): "
        "adds anchor_weight/2 * ||θ - θ0||² to the loss",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each TTT step's decoder layer in backward instead of keeping its activations: for "
        "rows of tens of thousands of tokens (docs/long-context.md; `eaglekit plan` gives the memory either way), "
        "about 40 % more step time",
    )
    attention: Literal["auto", "reference", "sdpa", "flex"] = Field(
        "auto",
        description="the TTT step's attention kernels: flex (fused flex attention for the draft steps and packed "
        "rows, FlashAttention for step 0; CUDA only), sdpa (FlashAttention for unpacked step 0 only), reference "
        "(the exact blockwise attention every other path is tested against); auto: flex on CUDA, else reference",
    )
    head_loss: Literal["auto", "reference", "compiled"] = Field(
        "auto",
        description="the draft head + loss per chunk of rows: compiled (torch.compile fuses its elementwise work) "
        "or reference; auto: compiled on CUDA, else reference",
    )
    compile: bool = Field(
        False, description="torch.compile the drafter's layer for the TTT step (fuses norms, RoPE, SwiGLU)"
    )

    @model_validator(mode="after")
    def _one_weight_per_step(self) -> TTTConfig:
        if self.step_weights is not None and len(self.step_weights) != self.steps:
            raise ValueError(
                f"step_weights has {len(self.step_weights)} weights for steps {self.steps}: give one per step"
            )
        return self

    @property
    def weights(self) -> StepWeights:
        """Each step's loss weight: step_weights when given, else decay^k."""
        if self.step_weights is not None:
            return StepWeights(self.step_weights)
        return StepWeights.decayed(self.steps, self.decay)


# train.ttt keys only EAGLE-3's TTT objective reads (drafters/eagle3/objective.py and ttt.py): set away from their
# defaults for a block drafter, they are refused (steps, decay and the step's kernels are left out: a config switched
# from EAGLE-3, as the demo's, has them, and they change nothing a block drafter learns)
TTT_ONLY_KEYS = ("step_weights", "loss", "loss_normalization", "noise", "noise_scale", "anchor_weight",
                 "activation_checkpointing")  # fmt: skip

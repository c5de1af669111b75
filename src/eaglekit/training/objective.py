"""What the training loop asks of a drafter family, and what it gets back. The loop is handed the family's
``Training`` (``stages/train.py`` asks the registry for it): it builds the drafter a run starts from (``Built``), the
objective that trains it (``Objective``: a module whose forward returns the loss and the step's figures), and writes
a checkpoint's drafter in the form the family's export reads. Nothing here names a family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from eaglekit.config import RunConfig, TrainConfig
from eaglekit.model.target import TargetReads
from eaglekit.training.context_parallel import ContextGroup


@dataclass
class Built:
    """The drafter a training run starts from, the target ids its features cover, and the notes for the ledger."""

    drafter: nn.Module
    feature_ids: torch.Tensor  # [V] bool over the target's vocabulary: the draft vocabulary, or all of it
    notes: dict[str, Any]


@dataclass
class Objective:
    """The training objective of a family as the loop runs it."""

    module: nn.Module  # its forward takes the loop's batch and returns (loss, per-position figures)
    positions: int  # figures it reports per draft position
    weights: list[float]  # their weights in the held-out loss
    kernels: str  # what it runs, for the ledger
    halo: int  # positions past a context-parallel rank's own whose targets it reads (training/context_parallel.py)
    reads: TargetReads  # what of the target its forward takes: the draft-vocab distribution, or the next token


class Training(Protocol):
    """A drafter family as the training loop and its checkpoints use it."""

    def build(
        self,
        cfg: RunConfig,
        hf: Any,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        embed: torch.Tensor,
        head: torch.Tensor,
        aux: list[int],
    ) -> Built:
        """Fresh from the target's config, or train.init_from's drafter."""
        ...

    def objective(
        self, drafter: nn.Module, tc: TrainConfig, device: torch.device, context: ContextGroup | None = None
    ) -> Objective:
        """Its objective on ``device`` (``context``: the ranks splitting each row under context parallelism)."""
        ...

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        """A training checkpoint's drafter, in the form evaluate and export read back."""
        ...

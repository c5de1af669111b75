"""What a drafter family supplies, through one typed interface, to the stages, the training loop, checkpointing and
decoding; none of them tests which family it holds (``drafters/registry.py`` finds it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from eaglekit.config import DraftSection, RunConfig, TrainConfig
from eaglekit.contract import StageContext
from eaglekit.drafters.diagnosis import ServedDrafter
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.training.context_parallel import ContextGroup
from eaglekit.training.memory import StepMemory
from eaglekit.training.objective import Built, Objective

# the checked drafter of a run: (drafter, checkpoint info, the target's HF config, aux layer ids)
LoadChecked = Callable[[RunConfig], tuple[Any, CheckpointInfo, Any, list[int]]]


@dataclass(frozen=True)
class Verdict:
    """A family's pre-flight answer; the stage that declares the check names it (``preflight.drafter.as_check``)."""

    level: Literal["ok", "warn", "fail", "skip"]
    detail: str
    remedy: str = ""


class DrafterFamily(Protocol):
    """A drafter family: EAGLE-3 (Llama or MLA attention), DFlash, DSpark. Registered once in
    ``drafters/registry.FAMILIES``."""

    @property
    def name(self) -> str:
        """Its train.draft.architecture value; also its name in messages."""
        ...

    @property
    def forms(self) -> tuple[str, ...]:
        """The export forms it can write (folder names under export/), the first the main one."""
        ...

    @property
    def draft_model(self) -> type[DraftSection]:
        """Its train.draft model (config.DRAFT_MODELS[name]): the keys it reads; another family's key is refused as
        the config loads."""
        ...

    @property
    def windowed(self) -> bool:
        """Whether train.draft.sliding_window gives it a sliding window (in training, decoding and its export): its
        draft model has the key."""
        ...

    @property
    def drafter_class(self) -> type[nn.Module]:
        """The model it builds and loads."""
        ...

    @property
    def vllm_cpu_refusal(self) -> str | None:
        """Why vLLM's CPU build refuses to serve it (verify fails before an engine starts, export warns), or None."""
        ...

    # ---- the drafter a fresh run builds, shaped after the target (plan, pre-flight and train size the same one)
    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> Any: ...

    def parameter_counts(self, dc: Any) -> tuple[int, int]:
        """(all parameters, trainable ones)."""
        ...

    def step_memory(
        self, cfg: RunConfig, tokens: int, context_parallel: int = 1
    ) -> tuple[StepMemory, StepMemory] | None:
        """One step's GPU memory at ``tokens`` a micro-batch (on one of ``context_parallel`` ranks splitting each
        row), without and with activation checkpointing; None when the family has no model of it."""
        ...

    # ---- pre-flight
    def shape_check(self, cfg: RunConfig) -> Verdict:
        """The drafter this run would train, refused now rather than at step 0."""
        ...

    def reads_folder(self, folder: Path) -> bool:
        """Whether a drafter folder holds this family's checkpoint (a trained or exported one)."""
        ...

    def finetune_check(self, cfg: RunConfig, folder: Path, path: str) -> Verdict:
        """Whether the drafter in ``folder`` (train.init_from ``path``) can be finetuned on this target."""
        ...

    # ---- training
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

    # ---- decoding
    def load_checkpoint(self, cfg: RunConfig, path: Path, aux: list[int]) -> tuple[Any, CheckpointInfo]:
        """A drafter folder of this family, ready to decode with the target (refused when it taps other layers)."""
        ...

    def fit_problems(self, drafter: Any, hf: Any, aux: list[int]) -> list[str]:
        """What keeps a loaded drafter from drafting for this target (empty when it fits)."""
        ...

    def vocab_line(self, dc: Any) -> str:
        """Its draft vocabulary in words, for pre-flight."""
        ...

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        """The ``speculative.decode.Proposer`` that drafts with it."""
        ...

    # ---- export
    def written_forms(self, requested: list[str]) -> list[str]:
        """The forms export writes when ``requested`` (export.formats) are asked for."""
        ...

    def vllm_method(self, form: str) -> str:
        """vLLM's --speculative-config method for one of its forms."""
        ...

    def planned_configs(self, dc: Any, forms: list[str], k: int) -> dict[str, dict]:
        """The config.json each of its ``forms`` will hold for the drafter config ``dc`` (``k``: the speculative
        tokens export writes), as far as the engines' feature checks read it (``serving/engine_features.py``)."""
        ...

    def verifier_check(self, cfg: RunConfig, formats: list[str]) -> Verdict: ...

    def sglang_check(self, cfg: RunConfig, formats: list[str]) -> Verdict: ...

    def export(self, ctx: StageContext, load: LoadChecked) -> dict:
        """Write the checked drafter (``load``: ``drafters/checked.load_checked_drafter``, called once the family
        has refused what it refuses without it) in its forms under ``ctx.dir``; the counts for the ledger."""
        ...

    # ---- verify
    def read_config(self, folder: Path) -> Any:
        """The drafter config a checkpoint folder of this family holds (what the engine-feature check reads)."""
        ...

    def diagnose(self, served: ServedDrafter) -> list[dict]:
        """Its causes of a served drafter accepting less than offline, one row each, ok or suspect, checked against
        what the engine reads from the served folder (verify's report lists them when a form fails)."""
        ...


def verifier_id(cfg: RunConfig) -> str:
    """What an export names as verifier: export.verifier, else the target itself (its hub id, or its local folder,
    which is only valid on this machine)."""
    return cfg.export.verifier or cfg.target.model

"""What a drafter family supplies to the pipeline: a ``DrafterFamily`` is its name and five roles, each a handful of
members asked by one part of the pipeline (``Sizing``: plan and pre-flight; ``Training``, in ``training/objective.py``:
the training loop; ``Reading``: evaluate, export and verify reading its folders; ``EngineForms``: export's forms and the
engines; ``Diagnosis``: pre-flight's and verify's verdicts). None of the pipeline tests which family it holds
(``drafters/registry.py`` finds it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from torch import nn

from eaglekit.config import DraftSection, RunConfig
from eaglekit.contract import StageContext
from eaglekit.drafters.diagnosis import ServedDrafter
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.training.memory import StepMemory
from eaglekit.training.objective import Training

# the checked drafter of a run: (drafter, checkpoint info, the target's HF config, aux layer ids)
LoadChecked = Callable[[RunConfig], tuple[Any, CheckpointInfo, Any, list[int]]]


@dataclass(frozen=True)
class Verdict:
    """A family's pre-flight answer; the stage that declares the check names it (``preflight.drafter.as_check``)."""

    level: Literal["ok", "warn", "fail", "skip"]
    detail: str
    remedy: str = ""


class Sizing(Protocol):
    """The drafter a fresh run builds, shaped after the target: ``plan``, pre-flight and train size the same one."""

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

    def vocab_line(self, dc: Any) -> str:
        """Its draft vocabulary in words, for pre-flight."""
        ...


class Reading(Protocol):
    """Its folders (a trained or an exported drafter) read back, and decoding with what they hold."""

    def reads_folder(self, folder: Path) -> bool:
        """Whether a drafter folder holds this family's checkpoint; the registry's ``family_of_folder`` asks."""
        ...

    def read_config(self, folder: Path) -> Any:
        """The drafter config a folder of this family holds (what the engine-feature check reads)."""
        ...

    def load_checkpoint(self, cfg: RunConfig, path: Path, aux: list[int]) -> tuple[Any, CheckpointInfo]:
        """A drafter folder of this family, ready to decode with the target (refused when it taps other layers)."""
        ...

    def fit_problems(self, drafter: Any, hf: Any, aux: list[int]) -> list[str]:
        """What keeps a loaded drafter from drafting for this target (empty when it fits)."""
        ...

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        """The ``speculative.decode.Proposer`` that drafts with it."""
        ...


@dataclass
class Written:
    """What a family's export wrote (``EngineForms.write``): the rest of the export stage (the model card, the
    printed commands, the counts) is ``stages/export.py``'s, the same for every family."""

    drafter: Any  # as written
    info: CheckpointInfo  # of the checkpoint it came from
    folders: dict[str, Path]  # each form written, and its folder
    commands: list[tuple[str, str]]  # (what, command) serving the forms
    warnings: list[str]  # the family's own, on what it wrote
    title: str  # the model card's title: "EAGLE-3 drafter"
    drafter_line: str  # the drafter's shape in one line
    holds: dict[str, str]  # what each form's folder holds, for the model card


class EngineForms(Protocol):
    """Its export forms, and what the serving engines make of them."""

    @property
    def forms(self) -> tuple[str, ...]:
        """The export forms it can write (folder names under export/), the first the main one."""
        ...

    @property
    def vllm_cpu_refusal(self) -> str | None:
        """Why vLLM's CPU build refuses to serve it (verify fails before an engine starts, export warns), or None."""
        ...

    def written_forms(self, requested: list[str]) -> list[str]:
        """The forms export writes when ``requested`` (export.formats) are asked for."""
        ...

    def planned_configs(self, dc: Any, forms: list[str], k: int) -> dict[str, dict]:
        """The config.json each of its ``forms`` will hold for the drafter config ``dc`` (``k``: the speculative
        tokens export writes), as far as the engines' feature checks read it (``serving/engine_features.py``)."""
        ...

    def vllm_method(self, form: str) -> str:
        """vLLM's --speculative-config method for one of its forms."""
        ...

    def vllm_options(self, form: str) -> dict[str, Any]:
        """The other keys of vLLM's --speculative-config one of its forms needs besides method, model and K (P-EAGLE's
        plain form: parallel_drafting); none for most."""
        ...

    def verifier_check(self, cfg: RunConfig, formats: list[str]) -> Verdict: ...

    def sglang_check(self, cfg: RunConfig, formats: list[str]) -> Verdict: ...

    def write(self, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
        """The checked drafter (``load``: ``drafters/checked.load_checked_drafter``, called once the family has
        refused what it refuses without it) written in the ``requested`` forms under ``ctx.dir``, each folder's keys,
        shapes and config validated and read back."""
        ...


class Diagnosis(Protocol):
    """Its verdicts: pre-flight's on the drafter a run trains and on ``train.init_from``, verify's on a served one."""

    def shape_check(self, cfg: RunConfig) -> Verdict:
        """The drafter this run would train, refused now rather than at step 0."""
        ...

    def finetune_check(self, cfg: RunConfig, folder: Path, path: str) -> Verdict:
        """Whether the drafter in ``folder`` (train.init_from ``path``) can be finetuned on this target."""
        ...

    def diagnose(self, served: ServedDrafter) -> list[dict]:
        """Its causes of a served drafter accepting less than offline, one row each, ok or suspect, checked against
        what the engine reads from the served folder (verify's report lists them when a form fails)."""
        ...


@dataclass(frozen=True)
class DrafterFamily:
    """A drafter family (EAGLE-3 with a Llama or an MLA layer, DFlash, DSpark): its name, its config model and its
    model class, and five roles, each asked by the part of the pipeline named on it. Registered once in
    ``drafters/registry.FAMILIES``; nothing outside ``drafters/`` tests which family it holds."""

    name: str  # its train.draft.architecture value; also its name in messages
    draft_model: type[DraftSection]  # config.DRAFT_MODELS[name]: the train.draft keys it reads
    drafter_class: type[nn.Module]  # the model it builds and loads
    windowed: bool  # train.draft.sliding_window gives it a sliding window (its draft model has the key)
    sizing: Sizing  # plan, pre-flight, train's estimates
    training: Training  # the training loop and its checkpoints
    reading: Reading  # evaluate, export, verify, the registry's family_of_folder
    engine: EngineForms  # export, verify, the engine-feature pre-flight
    diagnosis: Diagnosis  # train's pre-flight, verify's diagnosis


class EveryRole(Sizing, Training, Reading, EngineForms, Diagnosis, Protocol):
    """One object playing every role, as each family of this package is (a class whose methods are the members)."""

    @property
    def name(self) -> str: ...

    @property
    def draft_model(self) -> type[DraftSection]: ...

    @property
    def drafter_class(self) -> type[nn.Module]: ...

    @property
    def windowed(self) -> bool: ...


def one_object(family: EveryRole) -> DrafterFamily:
    """The family whose roles ``family`` plays, all of them."""
    return DrafterFamily(
        family.name, family.draft_model, family.drafter_class, family.windowed, family, family, family, family, family
    )


def verifier_id(cfg: RunConfig) -> str:
    """What an export names as verifier: export.verifier, else the target itself (its hub id, or its local folder,
    which is only valid on this machine)."""
    return cfg.export.verifier or cfg.target.model

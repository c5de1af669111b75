"""The DFlash2 family: DFlash with a grouped dynamic convolution around every sublayer and a path selector that
re-ranks each slot's top K given the token before it. It extends DFlash's family as its model extends DFlash's
(``model.py``), its form is written through DFlash's writer (``checkpoint.py``), it trains DFlash's block objective
with the selector's cross-entropy added (``DFlash2Drafter.extra_slot_loss``), and it drafts with the selector's walk
(``proposer.py``).

Serving: vLLM serves it as ``DFlash2DraftModel`` with ``method: dflash``; its selector runs only in the V2 model
runner. An engine that would serve it as plain DFlash (a V1 runner without vLLM 0.32's refusal) is named at export
(a warning) and refused at verify by the engine-feature table (``serving/engine_features.py``, row
``path_selector``); the CPU build cannot serve it at all (``checkpoint.NOT_ON_CPU``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglekit.config import DFlash2Draft, RunConfig, TrainConfig
from eaglekit.drafters.dflash.family import DFlashFamily
from eaglekit.drafters.dflash.objective import BlockObjective
from eaglekit.drafters.dflash2 import checkpoint as dflash2_checkpoint
from eaglekit.drafters.dflash2 import model as dflash2
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter
from eaglekit.drafters.dflash2.proposer import DFlash2Proposer
from eaglekit.drafters.family import one_object
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import text_config
from eaglekit.training.context_parallel import ContextGroup

DEFAULT_SELECTOR_LOSS_WEIGHT = 1.0  # speculators' selector_loss_alpha


class DFlash2Family(DFlashFamily):
    name = "dflash2"
    title = "DFlash2"
    forms = (dflash2_checkpoint.FORM,)
    exported_architecture = dflash2_checkpoint.ARCHITECTURE
    draft_model = DFlash2Draft
    drafter_class = DFlash2Drafter
    vllm_cpu_refusal = dflash2_checkpoint.NOT_ON_CPU

    def expected_state(self, dc: Any) -> dict[str, tuple[int, ...]]:
        return dflash2_checkpoint.expected_state(dc)

    def save_exported(self, drafter: Any, out: Path) -> None:
        dflash2_checkpoint.save_dflash2(drafter, out)

    def load_exported(self, path: str | Path, embed: torch.Tensor, head: torch.Tensor) -> DFlash2Drafter:
        return dflash2_checkpoint.load_dflash2(path, embed, head)

    def load_for_target(self, cfg: RunConfig, path: str | Path) -> DFlash2Drafter:
        return dflash2_checkpoint.load_for_target(path, cfg.target.model, cfg.target.trust_remote_code)

    def reads_folder(self, folder: Path) -> bool:
        return dflash2_checkpoint.is_dflash2_checkpoint(folder)

    def read_config(self, folder: Path) -> DFlash2Config:
        return dflash2_checkpoint.read_dflash2_config(folder)

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        dflash2_checkpoint.save_from_state(dc, state, out)

    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> DFlash2Config:
        return dflash2.config_for_run(cfg, hf, aux, int(text_config(hf).vocab_size))

    def shape_extra(self, dc: Any) -> str:
        return (
            f", convolution {dc.conv_kernel_size} taps x groups of {dc.conv_group_size}, selector top "
            f"{dc.selector_top_k} at rank {dc.selector_rank} over the full vocabulary ({dc.vocab_size})"
        )

    def serving_notes(self, cfg: RunConfig) -> list[str]:
        """The CPU build does not serve it (verify says so), so its k_norm does not matter there; what does: the
        selector ranks candidates from the target's own head, which vLLM needs unquantized."""
        quantized = getattr(text_config(target_and_aux(cfg)[0]), "quantization_config", None)
        if not quantized:
            return []
        return [
            "the target is quantized: vLLM's DFlash2 selector takes its candidates from the target's lm_head, which "
            "must stay unquantized (vllm-ascend#14533 refuses a quantized one)"
        ]

    def objective(
        self, drafter: Any, tc: TrainConfig, device: torch.device, context: ContextGroup | None = None
    ) -> Any:  # DFlash's Objective
        """DFlash's block objective; the selector's cross-entropy joins it, weighted by train.draft.
        selector_loss_weight (speculators' selector_loss_alpha, 1)."""
        objective = super().objective(drafter, tc, device, context)
        weight = tc.draft_as(DFlash2Draft).selector_loss_weight
        assert isinstance(objective.module, BlockObjective)
        objective.module.extra_weight = DEFAULT_SELECTOR_LOSS_WEIGHT if weight is None else weight
        objective.kernels += " + path selector cross-entropy"
        return objective

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        return DFlash2Proposer(drafter)

    def vllm_method(self, form: str) -> str:
        return dflash2_checkpoint.METHOD  # vLLM serves DFlash2DraftModel with method dflash

    def export_warnings(self, drafter: Any) -> list[str]:
        # warnings only: a GPU build's V2 runner serves it; the fallback is named so it is never taken for DFlash2
        return [dflash2_checkpoint.NOT_ON_CPU, dflash2_checkpoint.FALLBACK]


DFLASH2 = one_object(DFlash2Family())

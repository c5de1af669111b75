"""The DSpark family: DFlash's backbone drafting from the anchor, plus a Markov head over the block. A sibling of
DFlash: its model (``model/dspark.py``) subclasses DFlash's, its form (``model/dspark_checkpoint.py``) is written
through DFlash's writer, and this family extends DFlash's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglekit.config import DSparkDraft, RunConfig
from eaglekit.drafters.dflash.family import DFlashFamily
from eaglekit.drafters.dspark import checkpoint as dspark_checkpoint
from eaglekit.drafters.dspark import model as dspark
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.dspark.proposer import DSparkProposer
from eaglekit.drafters.family import one_object
from eaglekit.model.target import text_config

# vLLM 0.32 serves DSpark only in its V2 model runner; the V1 runner refuses it at config time with
# "Model Runner V1 does not support: dspark speculative decoding" (vllm/config/vllm.py:2979 and :3202), and the
# CPU build runs V1 because V2 needs Triton, which has no CPU backend (vllm/config/vllm.py:726 and :3190).
NOT_ON_CPU = (
    "vLLM's CPU build cannot serve a DSpark drafter: vLLM 0.32 refuses it with \"Model Runner V1 does not support: "
    'dspark speculative decoding" (DSpark is implemented only in the V2 model runner, which needs Triton, and '
    "Triton has no CPU backend); serve it with a GPU build of vLLM >= 0.32"
)


class DSparkFamily(DFlashFamily):
    name = "dspark"
    title = "DSpark"
    forms = (dspark_checkpoint.FORM,)
    exported_architecture = dspark_checkpoint.ARCHITECTURE
    draft_model = DSparkDraft
    drafter_class = DSparkDrafter
    vllm_cpu_refusal = NOT_ON_CPU
    anchor_slot_drafts = True  # its block's first slot drafts too (DFlash's holds the verified token)

    def expected_state(self, dc: Any) -> dict[str, tuple[int, ...]]:
        return dspark_checkpoint.expected_state(dc)

    def save_exported(self, drafter: Any, out: Path) -> None:
        dspark_checkpoint.save_dspark(drafter, out)

    def load_exported(self, path: str | Path, embed: torch.Tensor, head: torch.Tensor) -> DSparkDrafter:
        return dspark_checkpoint.load_dspark(path, embed, head)

    def load_for_target(self, cfg: RunConfig, path: str | Path) -> DSparkDrafter:
        return dspark_checkpoint.load_for_target(path, cfg.target.model, cfg.target.trust_remote_code)

    def reads_folder(self, folder: Path) -> bool:
        return dspark_checkpoint.is_dspark_checkpoint(folder)

    def read_config(self, folder: Path) -> DSparkConfig:
        return dspark_checkpoint.read_dspark_config(folder)

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        dspark_checkpoint.save_from_state(dc, state, out)

    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> DSparkConfig:
        return dspark.config_for_run(cfg, hf, aux, int(text_config(hf).vocab_size))

    def shape_extra(self, dc: Any) -> str:
        return f", Markov rank {dc.markov_rank}"

    def serving_notes(self, cfg: RunConfig) -> list[str]:
        return []  # the CPU build does not serve it at all (verify says so): its k_norm does not matter there

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        return DSparkProposer(drafter)

    def export_warnings(self, drafter: Any) -> list[str]:
        return [NOT_ON_CPU]  # a warning only: a GPU build serves it


DSPARK = one_object(DSparkFamily())

"""The DSpark drafter's checkpoint: the form vLLM 0.32 loads with ``method: dspark``, written and read key by key.

The form (``model_executor/models/qwen3_dspark.py``, ``config/speculative.py``, and the dense-DSpark keys that
``transformers_utils/configs/speculators/algos.py:update_dspark`` writes for vLLM):

- ``config.json``: the Qwen3 decoder config of DFlash's form (``dflash_checkpoint.vllm_config``), with
  ``architectures: [Qwen3DSparkModel]`` (registry: ``qwen3_dspark.Qwen3DSparkForCausalLM``; the name alone makes
  ``SpeculativeConfig`` pick ``method: dspark``), ``markov_rank`` and ``markov_head_type: vanilla`` (the only head
  ``Qwen3DSparkModel`` builds), ``enable_confidence_head: false``, the anchor-sampling layout
  ``sample_from_anchor: true`` / ``dspark_bonus_anchor: false`` (the speculator's default, and what vLLM's
  Qwen3-Omni DSpark validator requires), top-level ``mask_token_id`` (``get_parallel_drafting_token_id``) and
  ``target_layer_ids`` (decoder-layer outputs: vLLM adds 1, ``eagle3_utils.get_eagle3_aux_layers_from_config``'s
  "Dense DSpark" branch, which gives eaglekit's HF hidden_states indices). ``block_size`` is the default of
  ``num_speculative_tokens``: with anchor sampling a block of B queries drafts B tokens.
- ``model.safetensors``: DFlash's keys plus ``markov_head.markov_w1.weight`` [V, r] and
  ``markov_head.markov_w2.weight`` [V, r] (``Qwen3DSparkForCausalLM.load_weights`` prefixes ``model.``). No
  ``embed_tokens`` / ``lm_head`` (shared from the target: the full verifier vocabulary, so no ``d2t``), no
  ``confidence_head`` (the loader drops the head when the checkpoint has none).
- ``eaglekit.json``: the drafter config, to re-import it.

Serving: vLLM 0.32 implements DSpark only in its V2 model runner, which needs Triton; the CPU build has no Triton
and its V1 runner refuses the method (``verify`` names this before starting an engine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eaglekit.drafters.dflash import checkpoint as block
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.errors import UsageError
from eaglekit.model.target import embedding_and_head

ARCHITECTURE = "Qwen3DSparkModel"
FORM = "dspark"  # export/dspark/


def expected_state(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every exported key and its shape: DFlash's backbone and the Markov head."""
    markov = (cfg.vocab_size, cfg.markov_rank)
    return block.expected_state(cfg) | {"markov_head.markov_w1.weight": markov, "markov_head.markov_w2.weight": markov}


def vllm_config(cfg: DSparkConfig, dtype: torch.dtype) -> dict[str, Any]:
    config = block.vllm_config(cfg, dtype)
    dflash = config.pop("dflash_config")
    return config | {
        "architectures": [ARCHITECTURE],
        "mask_token_id": dflash["mask_token_id"],
        "target_layer_ids": dflash["target_layer_ids"],
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": False,
        "sample_from_anchor": True,
        "dspark_bonus_anchor": False,
    }


def save_dspark(drafter: DSparkDrafter, out_dir: str | Path) -> None:
    """Write the vLLM form (module docstring), validated key by key."""
    state = block.exported_state(drafter)
    block.validate_state(state, drafter.config, f"the DSpark drafter for {out_dir}", expected_state(drafter.config))
    block.write_folder(out_dir, vllm_config(drafter.config, drafter.fc.weight.dtype), drafter, state)


def save_from_state(cfg: DSparkConfig, state: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """A training checkpoint in the export's form (``state`` may lack the frozen embedding)."""
    drafter = DSparkDrafter(cfg)
    drafter.load_state_dict(state, strict=False)
    save_dspark(drafter, out_dir)


def read_dspark_config(path: Path) -> DSparkConfig:
    """The drafter config of an exported DSpark folder: eaglekit.json when present, else vLLM's config.json."""
    try:
        if (path / "eaglekit.json").is_file():
            return DSparkConfig.from_dict(json.loads((path / "eaglekit.json").read_text(encoding="utf-8")))
        c = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(
            f"{path}: cannot read the DSpark config ({err})", "point at an exported DSpark folder"
        ) from None
    missing = [k for k in ("mask_token_id", "target_layer_ids", "markov_rank") if k not in c]
    if ARCHITECTURE not in (c.get("architectures") or []) or missing:
        raise UsageError(
            f"{path}/config.json is not a DSpark drafter (architectures {c.get('architectures')}, missing {missing})",
            "point train.init_from at a folder eaglekit export wrote under export/dspark/",
        )
    if not c.get("sample_from_anchor", True) or c.get("markov_head_type", "vanilla") != "vanilla":
        raise UsageError(
            f"{path}/config.json: eaglekit trains and decodes DSpark with anchor sampling and the vanilla Markov "
            f"head; this one has sample_from_anchor {c.get('sample_from_anchor')}, markov_head_type "
            f"{c.get('markov_head_type')!r}",
            "use a drafter with sample_from_anchor: true and markov_head_type: vanilla",
        )
    backbone = block.backbone_config(c, c["target_layer_ids"], c["mask_token_id"], f"{path}/config.json")
    return DSparkConfig(**backbone.to_dict(), markov_rank=int(c["markov_rank"]))


def load_dspark(
    path: str | Path, embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype | None = None
) -> DSparkDrafter:
    """Re-import an exported drafter (to finetune or evaluate it), with the target's embedding and head."""
    path = Path(path)
    return block.load_weights_into(path, read_dspark_config(path), DSparkDrafter, expected_state, embed, head, dtype)


def is_dspark_checkpoint(path: str | Path) -> bool:
    """Whether a drafter folder holds a DSpark drafter (the family's hook for the stages)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


def load_for_target(path: str | Path, target_model: str, trust_remote_code: bool = False) -> DSparkDrafter:
    """An exported (or trained) DSpark drafter with the target's embedding and head read from its weights."""
    embed, head = embedding_and_head(target_model, trust_remote_code)
    return load_dspark(path, embed, head)


def serve_command(target: str, folder: Path, k: int) -> str:
    return block.serve_command(target, folder, k, method="dspark")


def block_form(path: str | Path) -> str | None:
    """The block-drafter form a folder holds (``dflash``, ``dspark``), or None (verify and the engine-feature
    checks still ask it; the pipeline's own code asks drafters/registry.family_of_folder)."""
    if is_dspark_checkpoint(path):
        return FORM
    return block.FORM if block.is_dflash_checkpoint(path) else None

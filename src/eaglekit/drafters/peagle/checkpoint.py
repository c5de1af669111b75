"""P-EAGLE's forms on disk: EAGLE-3's two (``drafters/eagle3/checkpoint.py``) with the slot token and ``mask_hidden``,
in exactly the form vLLM 0.32 reads.

Plain form (``export/eagle3/``): EAGLE-3's plain config (``LlamaForCausalLMEagle3``: vLLM's ``EAGLEConfig`` keeps an
architecture ending in Eagle3 and prefixes any other, so ``PEagleDraftModel`` would not resolve) plus
``pard_token``, one of the keys ``llm_base_proposer._init_parallel_drafting_params`` takes the slot token from (the
one vLLM's own speculators reader writes). Served with ``"parallel_drafting": true`` in ``--speculative-config``:
nothing in a plain config turns it on, and without it vLLM drafts a chain, skipping mask_hidden with a warning only.

speculators form (``export/speculators/``): ``speculators_model_type: peagle``, which vLLM serves as ``eagle3`` with
``parallel_drafting`` on (``transformers_utils/configs/speculators/base.py``); ``update_peagle`` (``algos.py``)
requires the top-level ``mask_token_id`` (it becomes ``pard_token``) but copies neither ``fc_norm`` nor
``norm_output``: they reach the model only from ``transformer_layer_config``, where this form writes them too.

Weights: EAGLE-3's, plus ``mask_hidden`` [1, 1, 3*Ht] (vLLM ``llama_eagle3.py: load_weights`` copies any key
containing it with ``.view(1, -1)`` into a buffer of 3*Ht; with parallel drafting on and the key absent it refuses
to load: "mask_hidden not found in weights").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3.checkpoint import LEGACY, SPECULATORS, _config_from_layer, _write
from eaglekit.drafters.eagle3.model import FLAGS
from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter
from eaglekit.errors import UsageError
from eaglekit.model.checkpoint_files import CheckpointInfo, read_json

SPECULATORS_TYPE = "peagle"
SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# the keys vLLM takes the slot token from, in its order (llm_base_proposer._init_parallel_drafting_params), less
# dflash_config's and dspark_noise_token_id, which no P-EAGLE config has
SLOT_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")


def slot_token(raw: dict) -> int | None:
    """The slot token vLLM reads from a plain config.json, or None (not a parallel drafter's)."""
    for key in SLOT_TOKEN_KEYS:
        if raw.get(key) is not None:
            return int(raw[key])
    return None


def is_peagle_folder(folder: Path) -> bool:
    try:
        raw = read_json(Path(folder) / "config.json")
    except UsageError:
        return False
    if "speculators_model_type" in raw:
        return raw["speculators_model_type"] == SPECULATORS_TYPE
    return slot_token(raw) is not None and ("draft_vocab_size" in raw or "Eagle3" in str(raw.get("architectures")))


def legacy_config(cfg: PEagleConfig) -> dict[str, Any]:
    return {**eagle3_checkpoint.legacy_config(cfg), "pard_token": int(cfg.mask_token_id)}


def speculators_config(
    cfg: PEagleConfig, verifier: str | None, verifier_architectures: list[str] | None, k: int
) -> dict[str, Any]:
    out = eagle3_checkpoint.speculators_config(cfg, verifier, verifier_architectures, k)
    out["architectures"] = [SPECULATORS_ARCHITECTURE]
    out["speculators_model_type"] = out["speculators_config"]["algorithm"] = SPECULATORS_TYPE
    out["mask_token_id"] = int(cfg.mask_token_id)
    # update_peagle drops the top-level flags but keeps the layer config's (vLLM builds the model config from it)
    out["transformer_layer_config"].update({name: getattr(cfg, name) for name in FLAGS})
    return out


def save_legacy(drafter: PEagleDrafter, out_dir: str | Path, include_embeddings: bool = True) -> None:
    state = eagle3_checkpoint._export_state(drafter, LEGACY, include_embeddings)
    _write(out_dir, legacy_config(drafter.config), state)


def save_speculators(
    drafter: PEagleDrafter,
    out_dir: str | Path,
    verifier: str | None,
    verifier_architectures: list[str] | None,
    k: int,
    include_embeddings: bool = True,
) -> str | None:
    config = speculators_config(drafter.config, verifier, verifier_architectures, k)
    _write(out_dir, config, eagle3_checkpoint._export_state(drafter, SPECULATORS, include_embeddings))
    if verifier is None:
        return (
            f"{out_dir}/config.json has no verifier: `vllm serve {out_dir}` needs "
            "speculators_config.verifier.name_or_path (set export.verifier to the target's hub id)"
        )
    return None


def read_config(path: Path) -> tuple[str, PEagleConfig, str | None]:
    """(form, config, verifier) of a P-EAGLE folder, read as vLLM reads it."""
    source = Path(path) / "config.json"
    raw = read_json(source)
    if raw.get("speculators_model_type") == SPECULATORS_TYPE:
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UsageError(f"{source}: transformer_layer_config is missing", "the speculators config is incomplete")
        if raw.get("mask_token_id") is None:  # update_peagle: config_dict["mask_token_id"], a KeyError in vLLM
            raise UsageError(f"{source}: no mask_token_id", "vLLM needs the slot token there; re-export the drafter")
        # what vLLM's model sees: the layer config's flags (update_peagle copies only norm_before_residual/_fc)
        flags = {name: bool(layer.get(name, False)) for name in FLAGS}
        flags["norm_before_residual"] = bool(raw.get("norm_before_residual", False))  # update_peagle's default
        flags["norm_before_fc"] = bool(raw.get("norm_before_fc", False))
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        base = _config_from_layer(layer, raw, source, raw.get("eagle_aux_hidden_state_layer_ids"), flags)
        return SPECULATORS, _parallel(base, int(raw["mask_token_id"]), source), verifier
    token = slot_token(raw)
    if token is None:
        raise UsageError(
            f"{source}: no slot token ({', '.join(SLOT_TOKEN_KEYS)}): not a P-EAGLE drafter",
            "point at a P-EAGLE drafter folder (export/eagle3 of a peagle run)",
        )
    form, base, verifier = eagle3_checkpoint.read_config(Path(path))
    return form, _parallel(base, token, source), verifier


def _parallel(base: Any, token: int, source: Path) -> PEagleConfig:
    try:
        return PEagleConfig(**dataclasses.asdict(base), mask_token_id=token)
    except UsageError as err:
        raise UsageError(f"{source}: {err.message}", err.remedy) from None


def load_drafter(path: str | Path, dtype: torch.dtype | None = None) -> tuple[PEagleDrafter, CheckpointInfo]:
    """A P-EAGLE folder in either form, its keys and shapes checked (``mask_hidden`` among them)."""
    drafter, info = eagle3_checkpoint.load_drafter(path, dtype, read=read_config, build=PEagleDrafter)
    assert isinstance(drafter, PEagleDrafter)
    return drafter, info

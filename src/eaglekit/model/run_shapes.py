"""The shapes a run config implies, read from the target's config.json without loading weights: the target's
config with its aux layer ids, and the drafter config train builds (plan and pre-flight size the same one)."""

from __future__ import annotations

from typing import Any

from eaglekit.config import RunConfig
from eaglekit.model import dflash, dspark
from eaglekit.model.dflash import DFlashConfig
from eaglekit.model.drafter import DrafterConfig, text_config
from eaglekit.model.target import aux_layer_ids, target_hf_config


def target_and_aux(cfg: RunConfig) -> tuple[Any, list[int]]:
    """(the target's HF text config, the aux layer ids the drafter taps), validated against the target's depth."""
    hf = target_hf_config(cfg.target)
    return hf, aux_layer_ids(cfg.target, hf.num_hidden_layers)


def drafter_config(cfg: RunConfig) -> DrafterConfig | DFlashConfig:
    """The drafter a fresh training run builds: shaped after the target, ``train.draft`` overriding."""
    hf, aux = target_and_aux(cfg)
    if cfg.train.draft.architecture == "dflash":  # the block-drafter family (model/dflash.py)
        return dflash.config_for_run(cfg, hf, aux, int(text_config(hf).vocab_size))
    if cfg.train.draft.architecture == "dspark":  # DFlash's backbone and a Markov head (model/dspark.py)
        return dspark.config_for_run(cfg, hf, aux, int(text_config(hf).vocab_size))
    return DrafterConfig.from_target_config(hf, cfg.vocab.draft_vocab_size, aux, **draft_settings(cfg))


def draft_settings(cfg: RunConfig) -> dict[str, Any]:
    """``train.draft`` as a fresh EAGLE-3 drafter is built from it: the EAGLE 3.1 flags ``fc_norm`` and
    ``norm_output`` are on unless set, for the Llama drafter — the τ race measured them ahead of the plain
    form on every seed (benchmarks/RESULTS.md, "The lever table"), and vLLM and SGLang read both. fc_norm stays
    off when norm_before_fc is asked for (one norm before fc or the other). The MLA drafter keeps them off unless
    set: it was not raced with them."""
    settings = cfg.train.draft.model_dump()
    if (settings.get("architecture") or "llama") == "llama":
        if settings.get("fc_norm") is None and not settings.get("norm_before_fc"):
            settings["fc_norm"] = True
        if settings.get("norm_output") is None:
            settings["norm_output"] = True
    return settings


def parameter_counts(dc: DrafterConfig | DFlashConfig) -> tuple[int, int]:
    """(all parameters, trainable ones) of a drafter: everything but the frozen [V, H] embedding trains."""
    from math import prod

    if isinstance(dc, DFlashConfig):  # the block-drafter family: the target's embedding and head stay frozen
        from eaglekit.model import dflash_checkpoint, dspark_checkpoint

        exported = (
            dspark_checkpoint.expected_state(dc)
            if isinstance(dc, dspark.DSparkConfig)
            else dflash_checkpoint.expected_state(dc)
        )
        trainable = sum(prod(shape) for shape in exported.values())
        return trainable + 2 * dc.vocab_size * dc.hidden_size, trainable
    from eaglekit.model.checkpoints import expected_state

    weights = {k: prod(shape) for k, (shape, dtype) in expected_state(dc).items() if dtype is None}  # not d2t/t2d
    total = sum(weights.values())
    return total, total - weights["embed_tokens.weight"]

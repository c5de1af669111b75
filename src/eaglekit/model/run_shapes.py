"""The shapes a run config implies, read from the target's config.json without loading weights: the target's
config with its aux layer ids (the drafter config train builds from it is its family's: ``drafters/``)."""

from __future__ import annotations

from typing import Any

from eaglekit.config import RunConfig
from eaglekit.model.target_config import aux_layer_ids, target_hf_config


def target_and_aux(cfg: RunConfig) -> tuple[Any, list[int]]:
    """(the target's HF text config, the aux layer ids the drafter taps), validated against the target's depth."""
    hf = target_hf_config(cfg.target)
    return hf, aux_layer_ids(cfg.target, hf.num_hidden_layers)

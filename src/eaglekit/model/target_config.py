"""The target's config.json, read without loading weights and without torch: its text config, rope and depth, the
aux layers a drafter taps, and its context.

`eaglekit status` and `plan` resolve a run (a stage's fingerprint reads the target's context through the window auto
chooses) from any shell while a run goes on; they must not pay for torch, nor for transformers where config.json
says the figure plainly (``target_context``). The full config (``target_hf_config``) is transformers' reading, with
its defaults and remote code: what training builds a drafter from.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eaglekit.config import TargetConfig
from eaglekit.errors import EaglekitError, UsageError

# Decoder-only model types whose config class keeps max_position_embeddings as config.json writes it (no attribute
# map, no nested text config): for these the JSON is transformers' reading of that figure. Any other type, or a
# config with remote code, is read by transformers.
PLAIN_DECODERS = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "deepseek_v2",
        "deepseek_v3",
        "glm4",
        "glm4_moe",
        "olmo2",
        "granite",
        "gpt_oss",
    }
)


def text_config(hf_config: Any) -> Any:
    """The language-model part of a HF config (multimodal configs nest it); dicts are accepted too."""
    if isinstance(hf_config, dict):
        hf_config = SimpleNamespace(**hf_config)
    get_text = getattr(hf_config, "get_text_config", None)
    if callable(get_text):
        return get_text()
    nested = getattr(hf_config, "text_config", None)
    return text_config(nested) if nested is not None else hf_config


def rope_from_config(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a HF config, transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):  # per-layer-type rope (e.g. gemma): take full attention
            params = params.get("full_attention") or next(iter(params.values()))
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, scaling


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(target_cfg: TargetConfig, num_layers: int) -> list[int]:
    """The configured aux taps, validated against the target's depth (each names the input of a decoder layer)."""
    ids = list(target_cfg.aux_layers) if target_cfg.aux_layers is not None else default_aux_layers(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if len(ids) != 3 or bad:
        raise UsageError(
            f"target.aux_layers {ids}: need three hidden_states indices in [0, {num_layers - 1}] "
            f"for a target with {num_layers} decoder layers",
            f"remove target.aux_layers to use the default {default_aux_layers(num_layers)}",
        )
    return ids


def target_hf_config(target_cfg: TargetConfig):
    """The target's (text) config, read without loading weights; a copy the caller may change."""
    config_file = Path(target_cfg.model) / "config.json"
    # one `plan` asks a dozen times (every stage's parameters and estimates): parsed once per content of the file
    # (its bytes are the key: a rewrite within the file system's timestamp granularity keeps the mtime)
    content = config_file.read_bytes() if config_file.is_file() else None
    return copy.deepcopy(_read_target_hf_config(target_cfg.model, target_cfg.trust_remote_code, content))


@functools.lru_cache(maxsize=8)
def _read_target_hf_config(model: str, trust_remote_code: bool, content: bytes | None):
    from transformers import AutoConfig  # lazy: heavy (transformers)

    try:
        return text_config(AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code))
    except (OSError, ValueError) as err:
        raise EaglekitError(
            f"cannot read the config of the target {model}: {err}", "point target.model at a Hugging Face model folder"
        ) from None


def target_context(target_cfg: TargetConfig) -> int | None:
    """The target's max_position_embeddings (vLLM's default max_model_len); None where its config says none. Read
    from config.json as JSON where the model type keeps the figure plainly (PLAIN_DECODERS), else through
    ``target_hf_config``; raises where the config is unreadable."""
    fields = _plain_decoder_fields(target_cfg)
    if fields is not None and isinstance(fields.get("max_position_embeddings"), int):
        return fields["max_position_embeddings"] or None
    return int(getattr(target_hf_config(target_cfg), "max_position_embeddings", 0) or 0) or None


def _plain_decoder_fields(target_cfg: TargetConfig) -> dict | None:
    """config.json of a local target of a PLAIN_DECODERS type without remote code, as JSON; None for any other."""
    config_file = Path(target_cfg.model) / "config.json"
    try:
        fields = json.loads(config_file.read_bytes())
    except (OSError, ValueError):
        return None  # a hub id, or a file transformers names the fault of
    if not isinstance(fields, dict) or fields.get("model_type") not in PLAIN_DECODERS:
        return None
    if target_cfg.trust_remote_code and "auto_map" in fields:
        return None
    return fields

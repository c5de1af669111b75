"""Why an EAGLE-3 drafter (Llama or MLA layer) can serve with less acceptance than offline: the six usual causes
(``data/verify_report.CAUSES``, most frequent first) and the engine-release check, each read from what the engine
reads of the served folder (``model/eagle3_checkpoint.served_settings``) beside what the drafter was trained with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglekit.data.verify_report import CAUSES
from eaglekit.drafters.diagnosis import ServedDrafter, cause_row, engine_drops, tensor_or_none
from eaglekit.drafters.eagle3.checkpoint import ServedSettings, read_config, served_settings
from eaglekit.drafters.eagle3.model import FLAGS
from eaglekit.errors import EaglekitError
from eaglekit.model.target import embedding_and_head, rope_from_config, target_hf_config, text_config


@dataclass
class EngineReading(ServedDrafter):
    """What ``engine`` reads from a served ``folder``, beside what the drafter was trained with: what every cause
    of the diagnosis looks at."""

    hf: Any  # the target's text config
    found: ServedSettings
    trained: dict[str, bool]  # the trained checkpoint's drafter flags


AUX_LAYER_IDS, NORM_BEFORE_RESIDUAL, ROPE, D2T_OFFSETS, EMBEDDING_SHARING, EAGLE31_FLAGS = CAUSES


def aux_layer_ids(r: EngineReading) -> dict:
    wrong = [ids for ids in r.found.aux_layer_ids if ids != r.aux]
    return cause_row(
        AUX_LAYER_IDS,
        bool(wrong),
        f"{r.engine} captures hidden_states {' or '.join(map(str, r.found.aux_layer_ids))} "
        f"(from {r.folder.name}/config.json); the drafter was trained on {r.aux}",
    )


def norm_before_residual(r: EngineReading) -> dict:
    found, trained = r.found.norm_before_residual, r.trained["norm_before_residual"]
    return cause_row(
        NORM_BEFORE_RESIDUAL,
        found != trained,
        f"{r.engine} reads norm_before_residual = {str(found).lower()}"
        + (" (the key is absent: vLLM's default for this form)" if r.found.norm_before_residual_defaulted else "")
        + f"; the drafter was trained with {str(trained).lower()}",
    )


def rope_settings(r: EngineReading) -> dict:
    found, hf = r.found, r.hf
    theta, scaling = rope_from_config(hf)
    mismatch = []
    if found.max_position_embeddings != int(hf.max_position_embeddings):
        mismatch.append(
            f"max_position_embeddings {found.max_position_embeddings} (target {hf.max_position_embeddings})"
        )
    if found.rope_theta != theta:
        mismatch.append(f"rope_theta {found.rope_theta} (target {theta})")
    if (found.rope_scaling or None) != (scaling or None):
        mismatch.append(f"rope_scaling {found.rope_scaling} (target {scaling})")
    return cause_row(
        ROPE,
        bool(mismatch),
        "; ".join(mismatch)
        or f"max_position_embeddings {found.max_position_embeddings}, rope_theta {found.rope_theta:g} — the target's",
    )


def d2t_offsets(r: EngineReading) -> dict:
    d2t = tensor_or_none(r.folder / "model.safetensors", "d2t")
    source_weights = r.checkpoint / "model.safetensors"
    trained_d2t = tensor_or_none(source_weights, "d2t") if source_weights.exists() else None
    if d2t is None or trained_d2t is None:
        return cause_row(
            D2T_OFFSETS,
            d2t is None and trained_d2t is not None,
            "no d2t in the served weights: the engine maps draft ids to target ids as the identity"
            if d2t is None
            else "the trained checkpoint has no d2t to compare with (full draft vocabulary)",
        )
    same = d2t.shape == trained_d2t.shape and torch.equal(d2t, trained_d2t)
    return cause_row(
        D2T_OFFSETS,
        not same,
        "d2t equals the trained checkpoint's"
        if same
        else "d2t differs from the trained checkpoint's: draft ids map to other target tokens",
    )


def embedding_sharing(r: EngineReading) -> dict:
    embed = tensor_or_none(r.folder / "model.safetensors", "embed_tokens.weight")
    if embed is None:
        return cause_row(
            EMBEDDING_SHARING, False, "no embed_tokens in the served weights: the engine shares the target's"
        )
    target_embed, _ = embedding_and_head(r.cfg.target.model, r.cfg.target.trust_remote_code)
    same = embed.shape == target_embed.shape and torch.equal(embed.to(target_embed.dtype), target_embed)
    return cause_row(
        EMBEDDING_SHARING,
        not same,
        "embed_tokens equals the target's (vLLM shares the target's)"
        if same
        else "embed_tokens differs from the target's: the engine embeds draft inputs with the drafter's own copy",
    )


def eagle31_flags(r: EngineReading) -> dict:
    flags, others = r.found.flags, ("fc_norm", "norm_output", "norm_before_fc")
    differ = [
        f"{name} {str(flags[name]).lower()} (trained {str(r.trained[name]).lower()})"
        for name in others
        if flags[name] != r.trained[name]
    ]
    return cause_row(
        EAGLE31_FLAGS,
        bool(differ),
        f"{r.engine} reads "
        + (
            "; ".join(differ)
            if differ
            else ", ".join(f"{name} {str(flags[name]).lower()}" for name in others) + " — as trained"
        ),
    )


# The causes in CAUSES' order, as the pre-flight checks are: one function each, ``diagnose`` runs them all.
DIAGNOSIS = (
    aux_layer_ids,
    norm_before_residual,
    rope_settings,
    d2t_offsets,
    embedding_sharing,
    eagle31_flags,
    engine_drops,
)


def diagnose(served: ServedDrafter) -> list[dict]:
    """The usual causes, most frequent first, each checked against what the engine reads from the served folder."""
    hf = text_config(target_hf_config(served.cfg.target))
    found = served_settings(served.folder, served.engine, int(hf.num_hidden_layers))
    reading = EngineReading(**vars(served), hf=hf, found=found, trained=trained_flags(served.checkpoint))
    return [cause(reading) for cause in DIAGNOSIS]


def trained_flags(checkpoint: Path) -> dict[str, bool]:
    """The drafter flags of the trained checkpoint (all false when it cannot be read: the drafter check says why)."""
    try:
        drafter = read_config(checkpoint)[1]
    except EaglekitError:
        return dict.fromkeys(FLAGS, False)
    return {name: getattr(drafter, name) for name in FLAGS}

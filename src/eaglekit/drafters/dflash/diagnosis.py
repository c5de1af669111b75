"""Why a block drafter (DFlash, DSpark) can serve with less acceptance than offline: its own causes
(``data/verify_report.BLOCK_CAUSES``) — the layers it reads, its mask token and block, RoPE, DSpark's block-slot
convention, a known engine defect — and the engine-release check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglekit.data.verify_report import BLOCK_CAUSES, CAUSES
from eaglekit.drafters.dflash.checkpoint import cpu_build_problem, read_dflash_config
from eaglekit.drafters.diagnosis import ServedDrafter, cause_row, engine_drops, read_json
from eaglekit.model.checkpoint_files import read_weights
from eaglekit.model.target import rope_from_config, target_hf_config, text_config
from eaglekit.serving import engine_features as features


@dataclass
class BlockReading(ServedDrafter):
    """What the engine reads from a served DFlash or DSpark folder, beside the trained drafter and the runs."""

    hf: Any  # the target's text config
    served: dict  # the served config.json
    trained: Any  # the trained checkpoint's DFlashConfig / DSparkConfig, None when unreadable
    dspark: bool


def diagnose(served: ServedDrafter, trained: Any, dspark: bool) -> list[dict]:
    """The block drafter's causes, each checked against the served folder's config and the trained drafter's
    (``trained``: its DFlashConfig / DSparkConfig, None when unreadable)."""
    hf = text_config(target_hf_config(served.cfg.target))
    reading = BlockReading(
        **vars(served), hf=hf, served=read_json(served.folder / "config.json"), trained=trained, dspark=dspark
    )
    return [cause(reading) for cause in BLOCK_DIAGNOSIS]


BLOCK_LAYER_IDS, MASK_AND_BLOCK, _, DSPARK_SLOTS, KNOWN_DEFECT, _ = BLOCK_CAUSES


def block_layer_ids(r: BlockReading) -> dict:
    ids = (r.served if r.dspark else r.served.get("dflash_config") or {}).get("target_layer_ids") or []
    read = [int(i) + 1 for i in ids]  # decoder-layer outputs: vLLM adds 1 (eagle3_utils)
    return cause_row(
        BLOCK_LAYER_IDS,
        read != r.aux,
        f"{r.engine} captures hidden_states {read} (target_layer_ids {list(ids)} + 1, from {r.folder.name}/config.json); "
        f"the drafter was trained on {r.aux}",
    )


def mask_and_block(r: BlockReading) -> dict:
    mask = (r.served if r.dspark else r.served.get("dflash_config") or {}).get("mask_token_id")
    block = r.served.get("block_size")
    slots = int(block or 0) - (0 if r.dspark else 1)  # DSpark's anchor slot drafts too
    problems = []
    if r.trained is not None and mask != r.trained.mask_token_id:
        problems.append(f"mask_token_id {mask} (trained {r.trained.mask_token_id})")
    if r.trained is not None and block != r.trained.block_size:
        problems.append(f"block_size {block} (trained {r.trained.block_size})")
    over = sorted({run["k"] for run in r.runs if run["k"] > slots})
    if over:
        problems.append(f"K {over} exceeds the {slots} draft slots of a block of {block}")
    return cause_row(
        MASK_AND_BLOCK, bool(problems), "; ".join(problems) or f"mask_token_id {mask}, block_size {block} — as trained"
    )


def block_rope(r: BlockReading) -> dict:
    theta, _ = rope_from_config(r.hf)
    served_theta = float((r.served.get("rope_parameters") or {}).get("rope_theta", r.served.get("rope_theta", 0.0)))
    served_max = r.served.get("max_position_embeddings")
    mismatch = []
    if served_max != int(r.hf.max_position_embeddings):
        mismatch.append(f"max_position_embeddings {served_max} (target {r.hf.max_position_embeddings})")
    if served_theta != theta:
        mismatch.append(f"rope_theta {served_theta:g} (target {theta:g})")
    return cause_row(
        CAUSES[2],
        bool(mismatch),
        "; ".join(mismatch) or f"max_position_embeddings {served_max}, rope_theta {served_theta:g} — the target's",
    )


def dspark_slots(r: BlockReading) -> dict:
    if not r.dspark:
        return cause_row(DSPARK_SLOTS, False, "DFlash: the anchor slot holds the verified token, the mask slots draft")
    if r.engine == "sglang":  # sglang 0.5.23 (dspark_config.get_dspark_sample_from_anchor): the flag alone
        anchor = r.served.get("sample_from_anchor", True)
        return cause_row(
            DSPARK_SLOTS,
            not anchor,
            f"sample_from_anchor {str(anchor).lower()} (trained: true, the anchor slot drafts), as SGLang 0.5.23 reads "
            "it; an SGLang release from before it told the convention by speculators_model_type (sglang#30261)",
        )
    anchor, bonus = r.served.get("sample_from_anchor", True), r.served.get("dspark_bonus_anchor", False)
    return cause_row(
        DSPARK_SLOTS,
        not anchor or bool(bonus),
        f"sample_from_anchor {str(anchor).lower()}, dspark_bonus_anchor {str(bonus).lower()} (trained: true, false: "
        "the anchor slot drafts)",
    )


def known_engine_defect(r: BlockReading) -> dict:
    """vLLM 0.32's CPU build applies layer 0's k_norm to every DFlash layer's context keys (dflash_checkpoint.py):
    named when the folder's weights trigger it on that build, and said to match when the served counts show it."""
    engine = features.engine_for(r.cfg.verify.server, r.cfg.verify.python) if r.engine == "vllm" else None
    kernel = engine.source / "model_executor/models/qwen3_dflash.py" if engine and engine.source else None
    stacked = kernel is not None and "_normalize_context_k" in kernel.read_text(errors="replace")
    if r.dspark or not (engine and engine.cpu_build and stacked):
        where = engine.label if engine else r.engine
        return cause_row(KNOWN_DEFECT, False, f"no known defect of {where} applies to this drafter")
    state, _ = read_weights(r.folder)
    problem = cpu_build_problem(state, read_dflash_config(r.folder))
    if problem is None:
        return cause_row(KNOWN_DEFECT, False, f"{engine.label}: every layer shares k_norm, its kernel reads it exactly")
    shown = [run for run in r.runs if shows_other_drafts(run)]
    if r.runs and not shown:
        return cause_row(KNOWN_DEFECT, False, f"{engine.label}: {problem}; the served counts do not show it here")
    counts = "; ".join(
        f"K={run['k']}: τ served {run['tau']['served']:.3f} vs offline {run['tau']['offline']:.3f}, greedy outputs "
        f"identical {run['greedy']['identical']}/{run['greedy']['prompts']}"
        for run in shown
    )
    return cause_row(
        KNOWN_DEFECT,
        True,
        f"{engine.label}: {problem}"
        + (f". The served counts match it (other drafts, the same greedy outputs): {counts}" if counts else "")
        + ". Train with train.draft.shared_k_norm: true to serve it there, or verify on a GPU build",
    )


def shows_other_drafts(run: dict) -> bool:
    """The served counts of a drafter served with other drafts than trained: acceptance (τ, a position, or the
    accepted count of some verify pass) differs, while the greedy outputs do not (the target verifies every draft)."""
    rounds = run.get("rounds") or {}
    same = run["checks"]["tau"] and run["checks"]["positions"] and rounds.get("identical") == rounds.get("compared")
    return bool(run["checks"]["greedy"]) and not same


BLOCK_DIAGNOSIS = (
    block_layer_ids,
    mask_and_block,
    block_rope,
    dspark_slots,
    known_engine_defect,
    engine_drops,
)

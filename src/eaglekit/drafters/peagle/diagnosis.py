"""Why a P-EAGLE drafter can serve with less acceptance than offline: EAGLE-3's causes (the same layer, read the
same way from the plain form), and two of its own, each read from what vLLM reads of the served folder:

* parallel drafting off — the plain form served without ``"parallel_drafting": true``: vLLM then drafts a chain,
  feeding each draft back as EAGLE-3 does, from a drafter never trained to (``llama_eagle3.py`` skips mask_hidden
  with a warning only);
* the slot token — the token vLLM puts in the slots (``_init_parallel_drafting_params``' order of keys) is not the
  one the drafter was trained with, or mask_hidden is not the trained one.
"""

from __future__ import annotations

import torch

from eaglekit.data.verify_report import BLOCK_CAUSES, ENGINE_DROPS
from eaglekit.drafters.diagnosis import ServedDrafter, cause_row, read_json, tensor_or_none
from eaglekit.drafters.eagle3 import diagnosis as eagle3_diagnosis
from eaglekit.drafters.peagle.checkpoint import SPECULATORS_TYPE, read_config, slot_token
from eaglekit.errors import EaglekitError

SLOT_TOKEN = BLOCK_CAUSES[1]  # "mask token / block size": the slots' token and feature


def parallel_drafting(r: ServedDrafter) -> dict:
    raw = read_json(r.folder / "config.json")
    if raw.get("speculators_model_type") == SPECULATORS_TYPE:
        return cause_row(ENGINE_DROPS, False, "speculators_model_type peagle: vLLM turns parallel_drafting on itself")
    # verify's own engine: its command line; a server you started (a URL): not known here
    launches = [str(run.get("launch", "")) for run in r.runs if "--speculative-config" in str(run.get("launch", ""))]
    if not launches:
        return cause_row(ENGINE_DROPS, False, "the server's command line is not known: it must say parallel_drafting")
    chained = [launch for launch in launches if '"parallel_drafting": true' not in launch.replace('":true', '": true')]
    return cause_row(
        ENGINE_DROPS,
        bool(chained),
        "served without parallel_drafting: vLLM drafted a chain from a drafter trained for parallel slots"
        if chained
        else "served with parallel_drafting: all K drafts in one pass, as trained",
    )


def slot_inputs(r: ServedDrafter) -> dict:
    raw = read_json(r.folder / "config.json")
    served = (
        int(raw["mask_token_id"])
        if raw.get("speculators_model_type") == SPECULATORS_TYPE and raw.get("mask_token_id") is not None
        else slot_token(raw)
    )
    try:
        trained = read_config(r.checkpoint)[1].mask_token_id
    except EaglekitError:
        return cause_row(SLOT_TOKEN, False, "the trained checkpoint cannot be read: the drafter check says why")
    mask = tensor_or_none(r.folder / "model.safetensors", "mask_hidden")
    trained_mask = tensor_or_none(r.checkpoint / "model.safetensors", "mask_hidden")
    same_mask = mask is not None and trained_mask is not None and torch.equal(mask.float(), trained_mask.float())
    problems = []
    if served != trained:
        problems.append(f"vLLM puts token {served} in the slots, the drafter was trained with {trained}")
    if not same_mask:
        problems.append("mask_hidden is missing or differs from the trained checkpoint's")
    return cause_row(
        SLOT_TOKEN, bool(problems), "; ".join(problems) or f"slot token {served} and mask_hidden as trained"
    )


def diagnose(served: ServedDrafter) -> list[dict]:
    raw = read_json(served.folder / "config.json")
    own = [parallel_drafting(served), slot_inputs(served)]
    if "speculators_model_type" in raw:  # EAGLE-3's readers do not read the peagle form
        return own
    return [row for row in eagle3_diagnosis.diagnose(served) if row["cause"] != ENGINE_DROPS] + own

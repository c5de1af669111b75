"""What verify's diagnosis of a served drafter shares across families: the folder an engine served, one row per
cause, and the cause every family has (an engine release that drops a trained feature).

Each family names its own causes, one function each in the style of the pre-flight checks, and runs them in its
``diagnose`` (``drafters/eagle3_diagnosis.py``, ``drafters/block_diagnosis.py``); verify asks the served folder's
family (``DrafterFamily.diagnose``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglekit.config import RunConfig
from eaglekit.data.verify_report import ENGINE_DROPS
from eaglekit.serving import engine_features as features


@dataclass
class ServedDrafter:
    """A drafter folder an engine served, and what it is compared with."""

    cfg: RunConfig
    folder: Path
    engine: str  # "vllm" or "sglang": whose reading of the folder the causes check
    aux: list[int]  # the aux layers the drafter was trained on
    checkpoint: Path  # the trained drafter it was exported from
    runs: list[dict]  # verify's compared runs of this folder (what a known engine defect is recognised by)


def cause_row(cause: str, suspect: bool, detail: str) -> dict:
    return {"cause": cause, "status": "suspect" if suspect else "ok", "detail": detail}


def engine_drops(r: ServedDrafter) -> dict:
    """Whether the measured engine reads every feature of the served config (serving/engine_features.py): the
    cause of both families."""
    engine = features.engine_for(r.cfg.verify.server, r.cfg.verify.python)
    if engine is None:
        return cause_row(ENGINE_DROPS, False, "no engine to check against")
    form, used = features.exported_features(read_json(r.folder / "config.json"))
    findings = features.assess(engine, form, used)
    drops = [f for f in findings if f.status == "drops"]
    if drops:
        return cause_row(ENGINE_DROPS, True, "; ".join(features.describe(engine, form, f) for f in drops))
    unknown = [f"{f.reading.feature} ({f.evidence})" for f in findings if f.status == "unknown"]
    read = ", ".join(f.reading.feature for f in findings if f.status == "reads") or "no feature the table names"
    return cause_row(
        ENGINE_DROPS,
        False,
        f"{engine.label} reads {read}" + (f"; cannot tell for {', '.join(unknown)}" if unknown else ""),
    )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tensor_or_none(weights: Path, name: str) -> torch.Tensor | None:
    with safe_open(str(weights), "pt") as f:
        return f.get_tensor(name) if name in set(f.keys()) else None

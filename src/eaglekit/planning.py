"""`eaglekit plan`: what each stage will write, and how long it will take where a rate is known.

Estimates come from the stages themselves (``estimate_bytes(ctx)``, ``estimate_seconds(ctx)``) and from the
ledger: a stage that already ran reports what it measured, so a rerun at a larger scale is planned from
this machine's own rates rather than guesses.
"""

from __future__ import annotations

from typing import Any

from eaglekit import pipeline
from eaglekit.config import RunConfig
from eaglekit.preflight.checks import human_bytes
from eaglekit.progress import format_duration


def plan(cfg: RunConfig) -> list[dict[str, Any]]:
    rows = []
    run_events = pipeline.RunDir(cfg.run_dir).last_events()
    for stage in cfg.stages():
        ctx = pipeline.make_context(cfg, stage)
        module = pipeline.stage_module(stage)
        writes = seconds = None
        basis = []
        try:
            if hasattr(module, "estimate_bytes"):
                writes = module.estimate_bytes(ctx)
            if hasattr(module, "estimate_seconds"):
                est = module.estimate_seconds(ctx)
                if est is not None:
                    seconds, why = est
                    basis.append(why)
        except Exception as err:  # an estimate that needs upstream outputs cannot be made yet
            basis.append(f"no estimate yet ({type(err).__name__}: {err})")
        end = (run_events.get(stage) or {}).get("end")
        if seconds is None and end and end.get("state") == "done":
            seconds = end.get("seconds")
            basis.append("measured in this run")
        if writes is None and not basis:
            basis.append("needs the outputs of earlier stages")
        rows.append({"stage": stage, "writes_bytes": writes, "seconds": seconds,
                     "writes_human": human_bytes(writes) if writes is not None else "?",
                     "time_human": format_duration(seconds) if seconds is not None else "?",
                     "basis": "; ".join(basis)})
    return rows

"""Pre-flight checks that the engine reads every feature of the drafter (export and verify declare them): the table
and the probe are ``eaglekit.serving.engine_features``."""

from __future__ import annotations

from eaglekit.contract import StageContext
from eaglekit.drafters.checked import checkpoint_path, drafter_family, written_forms
from eaglekit.drafters.registry import family_of_folder
from eaglekit.errors import EaglekitError
from eaglekit.preflight import CheckResult, fail, ok, skip, warn, will_be_produced
from eaglekit.serving import engine_features as features

NAME = "engine reads the drafter"


def _result(check, engine: features.Engine | None) -> CheckResult:
    if engine is None:
        return skip(NAME, "no engine installed or configured to check against")
    try:
        warnings = check()
    except EaglekitError as err:
        return fail(NAME, err.message, err.remedy or "")
    if warnings:
        return warn(NAME, " | ".join(warnings), "run verify against the engine you serve with")
    return ok(NAME, f"{engine.label} reads every feature of the drafter")


def exported_features_read(ctx: StageContext) -> CheckResult:
    """export: the forms it will write, against the vLLM on this machine."""
    pending = None if ctx.cfg.evaluate.checkpoint else will_be_produced(ctx, NAME, "train")
    if pending:
        return pending
    path = checkpoint_path(ctx.cfg)
    family = family_of_folder(path)
    try:
        drafter = family.reading.read_config(path) if family else None
    except EaglekitError:
        drafter = None
    if drafter is None:
        return skip(NAME, "the drafter checkpoint cannot be read (the drafter check says why)")
    requested = list(dict.fromkeys(ctx.options.get("formats") or ctx.cfg.export.formats))
    family = drafter_family(ctx.cfg)
    formats = family.engine.written_forms(requested)  # what export writes: an MLA drafter, eagle3 alone
    planned = family.engine.planned_configs(drafter, formats, ctx.cfg.export.num_speculative_tokens)
    engine = features.engine_for(None, ctx.cfg.verify.python)
    return _result(lambda: features.export_check(ctx.cfg, planned), engine)


def served_features_read(ctx: StageContext) -> CheckResult:
    """verify: the exported folders it will serve, against the engine it measures."""
    vc = ctx.cfg.verify
    if not (vc.engine or vc.server):
        return skip(NAME, "verify is not configured")
    pending = will_be_produced(ctx, NAME, "export")
    if pending:
        return pending

    export = ctx.cfg.run_path / "export"
    folders = {form: export / form for form in dict.fromkeys(vc.formats or written_forms(ctx.cfg))}
    engine = features.engine_for(vc.server, vc.python)
    return _result(lambda: features.verify_check(ctx.cfg, folders), engine)

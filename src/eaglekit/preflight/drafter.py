"""Pre-flight checks of the trained drafter and of the evaluation prompts (evaluate, export and verify declare them),
and ``as_check``: a drafter family's verdict (``drafters/family.Verdict``) as a pre-flight check."""

from __future__ import annotations

from eaglekit.contract import StageContext
from eaglekit.drafters.checked import load_checked_drafter
from eaglekit.drafters.family import Verdict
from eaglekit.drafters.registry import family_of_drafter
from eaglekit.errors import EaglekitError
from eaglekit.preflight import CheckResult, fail, ok, will_be_produced
from eaglekit.speculative.inputs import eval_prompts


def drafter_checkpoint(ctx: StageContext):
    pending = None if ctx.cfg.evaluate.checkpoint else will_be_produced(ctx, "drafter checkpoint", "train")
    if pending:
        return pending
    try:
        drafter, info, _, aux = load_checked_drafter(ctx.cfg)
    except EaglekitError as err:
        return fail("drafter checkpoint", err.message, err.remedy or "check the drafter folder")
    c = drafter.config
    vocab = family_of_drafter(drafter).sizing.vocab_line(c)
    return ok(
        "drafter checkpoint",
        f"{info.path} ({info.form} form): hidden {c.hidden_size}, draft vocab {vocab}, aux layers {aux}; fits the target",
    )


def as_check(name: str, verdict: Verdict) -> CheckResult:
    """A drafter family's verdict as the pre-flight check ``name``."""
    return CheckResult(name, verdict.level, verdict.detail, verdict.remedy)


def prompts_available(ctx: StageContext):
    pending = None if ctx.cfg.evaluate.prompts else will_be_produced(ctx, "evaluation prompts", "generate")
    if pending:
        return pending
    try:
        prompts = eval_prompts(ctx.cfg)
    except EaglekitError as err:
        return fail("evaluation prompts", err.message, err.remedy or "check evaluate.prompts")
    source = ctx.cfg.evaluate.prompts or "the held-out split of generate/responses.jsonl"
    wanted = ctx.cfg.evaluate.num_samples
    short = f" (of {wanted} asked: that is all there are)" if len(prompts) < wanted else ""
    return ok("evaluation prompts", f"{len(prompts)} prompts from {source}{short}")

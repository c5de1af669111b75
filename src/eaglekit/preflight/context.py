"""Pre-flight: the context the drafter will be served at against the length of the documents it trains on.

EAGLE-3 drafters trained on short rows lose most of their acceptance far past their training length (a Qwen3-8B
drafter: τ 2.30 at 2K context, 1.69 at 8K, 1.09 at 16K on LongBench-v2, speculators#684), while the same drafter
with a sliding window holds. Nothing fails loudly there: the served drafter simply stops paying for itself. This
check says so before training, from the prepared documents and ``evaluate.context_lengths`` (default: the
target's ``max_position_embeddings``, which vLLM serves up to unless told otherwise): what
``train.draft.sliding_window: auto`` (the default) chose from the same figures (``model/sliding_window.py``), and a
warning where the drafter is still served far beyond its training without a window (set to null, a family without
windows, a finetune) or has a window longer than its training documents. The figures, the window and its reason are
the run's resolution (``ctx.resolved``), the ones plan and train print: the documents' median length, as auto reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglekit.contract import StageContext
from eaglekit.drafters.registry import family_named
from eaglekit.model.checkpoint_files import layer_window
from eaglekit.model.sliding_window import FAR_BEYOND
from eaglekit.preflight import CheckResult, ok, skip, warn, will_be_produced

NAME = "serving context"


def serving_context(ctx: StageContext) -> CheckResult:
    cfg = ctx.cfg
    pending = will_be_produced(ctx, NAME, "prepare")
    if pending:
        return pending
    tokens = ctx.run.stage_dir("prepare") / "tokens.safetensors"
    if not tokens.exists():
        return skip(NAME, f"{tokens} not there yet")
    trained = ctx.resolved.lengths
    if trained is None:
        return skip(NAME, "no prepared documents")
    served = ctx.resolved.served
    if served is None:
        return skip(NAME, "the target's config has no max_position_embeddings; set evaluate.context_lengths")
    window, windowable, why = drafter_window(ctx)
    documents = trained.words()
    if trained.prepared and trained.longest > served.tokens:  # rows the served context can never hold
        return warn(
            NAME,
            f"the drafter trains on rows of up to {trained.longest:,} tokens, longer than the {served.tokens:,} it "
            f"will be served at ({served.source}): it is made for contexts it is not served at",
            f"set evaluate.context_lengths to the contexts you serve (at least {trained.longest:,} for these rows), "
            f"or cut the rows to the served context (prepare.max_length: {served.tokens}) before training",
        )
    where = served.words
    if window is not None:
        if trained.median < window:
            return warn(
                NAME,
                f"the drafter attends a {window:,}-token window but trains on {documents}: the far part of its "
                f"window is never trained, and it is {where}",
                "train on documents at least as long as the window (longer replies or prepare.max_length), or "
                "set train.draft.sliding_window to about the training length (auto chooses one: remove the key)",
            )
        if window >= served.tokens:  # as long as the served context: it never slides
            return warn(
                NAME,
                f"the drafter's {window:,}-token sliding window never fills at the {served.tokens:,} tokens it will "
                f"be served at ({served.source}): it attends every served position, as without a window",
                f"set train.draft.sliding_window below {served.tokens:,} (auto chooses one: remove the key), or set "
                "evaluate.context_lengths to the longer contexts you serve",
            )
        return ok(NAME, f"a {window:,}-token window ({why}), trained on {documents}; {where}")
    ratio = served.tokens / max(trained.median, 1)
    if ratio >= FAR_BEYOND and served.long:
        return warn(
            NAME,
            f"the drafter trains on {documents} and will be {where}, {ratio:.0f}x longer, with no window ({why}): "
            "drafters trained short lose most of their acceptance far past their training length (τ 2.30 at 2K "
            "context, 1.09 at 16K: speculators#684)",
            (
                "train on longer documents (eaglekit trains windows for fresh llama EAGLE-3 and block drafters only)"
                if not windowable
                else "remove train.draft.sliding_window: null (auto then windows the drafter: docs/long-context.md), "
                "or train on longer documents"
                if cfg.train.draft.window is None
                else "train on longer documents"
            )
            + ", or set evaluate.context_lengths to the contexts you serve",
        )
    return ok(NAME, f"trained on {documents}; {where}; no window ({why})")


def drafter_window(ctx: StageContext) -> tuple[int | None, bool, str]:
    """(the sliding window the trained drafter will have, whether train.draft.sliding_window can give it one, where
    the window comes from): a finetune keeps its own (read from a local init_from's config.json), a fresh drafter
    takes train.draft's, auto as model/sliding_window.py resolves it."""
    cfg = ctx.cfg
    if cfg.train.init_from:
        config = Path(cfg.train.init_from) / "config.json"
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            return None, False, f"{cfg.train.init_from} has no readable config.json"
        layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else raw
        return layer_window(layer), False, f"train.init_from {cfg.train.init_from}'s own"
    choice = ctx.resolved.window
    return choice.window, family_named(ctx.resolved.family).windowed, choice.why

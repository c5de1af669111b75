"""Pre-flight: the context the drafter will be served at against the length of the documents it trains on.

EAGLE-3 drafters trained on short rows lose most of their acceptance far past their training length (a Qwen3-8B
drafter: τ 2.30 at 2K context, 1.69 at 8K, 1.09 at 16K on LongBench-v2, speculators#684), while the same drafter
with a sliding window holds. Nothing fails loudly there: the served drafter simply stops paying for itself. This
check says so before training, from the prepared documents and ``evaluate.context_lengths`` (default: the
target's ``max_position_embeddings``, which vLLM serves up to unless told otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglekit.contract import StageContext
from eaglekit.data.tokens import TokenStore
from eaglekit.drafters.registry import family_named
from eaglekit.model.eagle3_checkpoint import layer_window
from eaglekit.model.target import target_hf_config
from eaglekit.preflight import CheckResult, ok, skip, warn, will_be_produced

NAME = "serving context"
# Served this many times beyond the training documents' 95th percentile, a plain drafter has lost most of its
# acceptance in the published measurements (4x: 2K -> 8K, τ -27 %; 8x: τ -53 %).
FAR_BEYOND = 4.0
# Without evaluate.context_lengths the target's own context stands for what is served only where it is long: a model
# of a few thousand positions is served at short contexts (the built-in tiny target: 1,024).
LONG_CONTEXT = 8192


def serving_context(ctx: StageContext) -> CheckResult:
    cfg = ctx.cfg
    pending = will_be_produced(ctx, NAME, "prepare")
    if pending:
        return pending
    tokens = ctx.run.stage_dir("prepare") / "tokens.safetensors"
    if not tokens.exists():
        return skip(NAME, f"{tokens} not there yet")
    lengths = TokenStore(tokens).lengths.double()
    if lengths.numel() == 0:
        return skip(NAME, "no prepared documents")
    p95, longest = int(lengths.quantile(0.95)), int(lengths.max())
    if cfg.evaluate.context_lengths:
        served, source = max(cfg.evaluate.context_lengths), "evaluate.context_lengths"
    else:
        served = int(getattr(target_hf_config(cfg.target), "max_position_embeddings", 0) or 0)
        source = "the target's max_position_embeddings"
        if not served:
            return skip(NAME, "the target's config has no max_position_embeddings; set evaluate.context_lengths")
    window, windowable = drafter_window(cfg)
    trained = f"documents of up to {p95:,} tokens (95th percentile; the longest {longest:,})"
    if window is not None:
        if p95 < window:
            return warn(
                NAME,
                f"the drafter attends a {window:,}-token window but trains on {trained}: the far part of its window "
                "is never trained, and it is served at up to "
                f"{served:,} tokens ({source})",
                "train on documents at least as long as the window (longer replies or prepare.max_length), or "
                "set train.draft.sliding_window to about the training length",
            )
        return ok(NAME, f"a {window:,}-token window, trained on {trained}; served at up to {served:,} ({source})")
    ratio = served / max(p95, 1)
    if ratio >= FAR_BEYOND and (cfg.evaluate.context_lengths or served >= LONG_CONTEXT):
        return warn(
            NAME,
            f"the drafter trains on {trained} and will be served at up to {served:,} ({source}), {ratio:.0f}x "
            "longer: drafters trained short lose most of their acceptance far past their training length (τ 2.30 "
            "at 2K context, 1.09 at 16K: speculators#684)",
            (
                f"train.draft.sliding_window: {min(2048, max(p95, 2)):,} (a window the training documents fill; "
                "docs/long-context.md), or train on longer documents"
                if windowable
                else "train on longer documents (eaglekit trains windows for fresh llama EAGLE-3 and block drafters only)"
            )
            + ", or set evaluate.context_lengths to the contexts you serve",
        )
    return ok(NAME, f"trained on {trained}; served at up to {served:,} ({source})")


def drafter_window(cfg) -> tuple[int | None, bool]:
    """(the sliding window the trained drafter will have, whether train.draft.sliding_window can give it one): a
    finetune keeps its own (read from a local init_from's config.json), a fresh drafter takes train.draft's."""
    if cfg.train.init_from:
        config = Path(cfg.train.init_from) / "config.json"
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            return None, False
        layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else raw
        return layer_window(layer), False
    return cfg.train.draft.window, family_named(cfg.train.draft.architecture).windowed

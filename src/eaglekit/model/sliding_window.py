"""The sliding window a run's drafter trains with: ``train.draft.sliding_window`` as written, or, for ``auto`` (the
default), chosen from the context the drafter will be served at against the length of the documents it trains on.

A drafter trained on short rows loses its acceptance when served far beyond them (a Qwen3-8B EAGLE-3 drafter: τ 2.30
at 2K context, 1.09 at 16K, speculators#684); one whose window is no longer than its training rows keeps it. On the
long-context tiny target (benchmarks/results/long-context.md, "The window's size"),
rows of ~650 tokens, EAGLE-3 windows of 256 and 512 kept 95-98 % of the < 1K τ at > 16K against 69-74 % for the
plain drafter and gave up nothing measurable at < 1K, while a 2,048 window, longer than the rows, kept 82-85 %; DFlash
windows of 256 kept 88 % / 84 % (K=3 / K=5) and 512 79 % / 75 %, against 52 % / 49 % plain, and 256 was ahead of 512
in every context group ("Three seeds of DFlash, served τ, a window longer than the rows"). A window about as long as
the rows lets the drafter learn reaches to the start of its row that it cannot make when served long; one of half
their length trains every distance it spans on at least half of a typical row's positions. So ``auto`` windows the
drafter when it is served FAR_BEYOND times its training documents' median length or more, with the largest power of
two no longer than half that length, at most LARGEST_AUTO_WINDOW; otherwise, and for a family that takes no window
(MLA), it attends the whole context. The median, not a high percentile, is the typical row: a user who serves long
keeps some long rows among the short (on the legend target, v6, 24 long rows among 160 short lifted the windowed
drafter from 88 % to 96.5 % kept at > 16K over three seeds: "The goal on v6"), and those few rows must neither turn
the window off nor stretch it past what most rows train. A target of a few thousand positions served at its own
context is short: the built-in tiny target (1,024) keeps full attention, and the demo's figures with it.
The figures are read once per command, by the run's resolution (``eaglekit.resolved``), and plan, pre-flight and train
read the window, its reason and the figures from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from eaglekit.config import AUTO, DRAFT_KEYS, RunConfig
from eaglekit.data.tokens import sample_lengths
from eaglekit.data.vocab import PREPARED_TOKENS
from eaglekit.errors import EaglekitError

# Served this many times beyond its training documents' length, a plain drafter has lost most of its
# acceptance in the published measurements (4x: 2K -> 8K, τ -27 %; 8x: τ -53 %).
FAR_BEYOND = 4.0
# Without evaluate.context_lengths the target's own context stands for what is served only where it is long: a model
# of a few thousand positions is served at short contexts (the built-in tiny target: 1,024).
LONG_CONTEXT = 8192
# speculators' window on every draft layer by default: longer windows than it are not chosen for the user
LARGEST_AUTO_WINDOW = 2048


@dataclass(frozen=True)
class ServedContext:
    tokens: int  # the longest context the drafter will be served at
    source: str  # where that figure comes from
    long: bool  # whether it stands for a long served context (given, or a target of LONG_CONTEXT positions or more)

    @property
    def words(self) -> str:
        return f"served at up to {self.tokens:,} ({self.source})"


@dataclass(frozen=True)
class TrainingLengths:
    median: int  # the prepared documents' median length, in tokens: the typical row, which auto's rule reads
    p95: int  # their 95th-percentile length
    longest: int
    prepared: bool  # False: prepare has not written them yet, and prepare.max_length stands in for all three

    def words(self) -> str:
        """The length auto's rule reads (the median), in words."""
        if not self.prepared:
            return f"documents of up to {self.median:,} tokens (prepare.max_length, until prepare has written them)"
        return f"documents of {self.median:,} tokens (median; 95th percentile {self.p95:,})"


@dataclass(frozen=True)
class WindowChoice:
    window: int | None  # the drafter's sliding window; None: it attends the whole context
    why: str  # in words: the setting, or what auto read and chose

    @property
    def shown(self) -> str:
        return "none" if self.window is None else f"{self.window:,}"


class WindowFigures(Protocol):
    """What auto's rule reads besides the config, each read once per command (``eaglekit.resolved.ResolvedRun``)."""

    @property
    def served(self) -> ServedContext | None: ...

    @property
    def lengths(self) -> TrainingLengths | None: ...


def served_context(context_lengths: list[int] | None, max_position_embeddings: int | None) -> ServedContext | None:
    """The context the drafter will be served at: evaluate.context_lengths, else the target's
    max_position_embeddings (vLLM's default max_model_len); None when neither says (an unreadable target's config
    is pre-flight's to name)."""
    if context_lengths:
        return ServedContext(max(context_lengths), "evaluate.context_lengths", True)
    if not max_position_embeddings:
        return None
    served = max_position_embeddings
    return ServedContext(served, "the target's max_position_embeddings", served >= LONG_CONTEXT)


def training_lengths(cfg: RunConfig) -> TrainingLengths | None:
    """The prepared documents' lengths (prepare.max_length stands in before prepare has run); None: prepare wrote
    no documents, or a file eaglekit cannot read (train's own reading names it)."""
    tokens = Path(cfg.run_dir) / PREPARED_TOKENS
    try:
        stat = tokens.stat()
    except OSError:
        return TrainingLengths(cfg.prepare.max_length, cfg.prepare.max_length, cfg.prepare.max_length, prepared=False)
    try:
        return _lengths(str(tokens), stat.st_mtime_ns, stat.st_size)
    except EaglekitError:
        return None


@lru_cache(maxsize=8)
def _lengths(path: str, mtime_ns: int, size: int) -> TrainingLengths | None:
    """Read once per version of the file (mtime and size key it): each command resolves the run anew."""
    lengths = sorted(sample_lengths(path))  # the offsets alone, without torch (`eaglekit status` resolves runs)
    if not lengths:
        return None
    return TrainingLengths(_quantile(lengths, 0.5), _quantile(lengths, 0.95), lengths[-1], prepared=True)


def _quantile(ordered: list[int], q: float) -> int:
    """The ``q`` quantile of sorted lengths, rounded down, as torch.quantile computes it in float64: interpolated
    linearly between the two nearest ranks with a fused multiply-add (the figures train printed before)."""
    rank = q * (len(ordered) - 1)
    below, above = math.floor(rank), math.ceil(rank)
    low, high, weight = float(ordered[below]), float(ordered[above]), rank - below

    def fused(x: float, y: float, z: float) -> float:  # x * y + z, rounded once
        return float(Fraction(x) * Fraction(y) + Fraction(z))

    if weight < 0.5:
        return int(fused(weight, high - low, low))
    return int(fused(low - high, 1 - weight, high))


def draft_window(cfg: RunConfig, figures: WindowFigures) -> WindowChoice:
    """The window a fresh drafter of this run trains with, and why (module docstring); a finetune keeps its own.
    ``figures`` are read only where auto needs them."""
    draft = cfg.train.draft
    if "sliding_window" not in DRAFT_KEYS[draft.family]:  # said once, here: MLA refuses the key
        return WindowChoice(None, f"auto: off (architecture {draft.family} takes no sliding window)")
    setting = draft.window
    if setting != AUTO:
        shown = "null (full attention)" if setting is None else f"{setting:,}"
        return WindowChoice(setting, f"train.draft.sliding_window: {shown}")
    if cfg.train.init_from:
        return WindowChoice(None, "auto: train.init_from keeps its own window")
    served = figures.served
    if served is None:
        return WindowChoice(
            None,
            "auto: off (the served context is unknown: no max_position_embeddings in the target's config; "
            "set evaluate.context_lengths)",
        )
    if not served.long:
        return WindowChoice(
            None, f"auto: off ({served.words}: a short context; set evaluate.context_lengths to what you serve)"
        )
    trained = figures.lengths
    if trained is None:
        return WindowChoice(None, "auto: off (no readable prepared documents)")
    described = trained.words()
    ratio = served.tokens / max(trained.median, 1)
    if ratio < FAR_BEYOND:
        return WindowChoice(
            None, f"auto: off ({served.words}, {ratio:.1f}x the training {described}: under {FAR_BEYOND:g}x)"
        )
    size = min(LARGEST_AUTO_WINDOW, 1 << (max(trained.median // 2, 1).bit_length() - 1))
    if size <= cfg.train.ttt.steps:
        return WindowChoice(
            None,
            f"auto: off ({served.words}, but the training {described} leave a window of {size} positions, "
            f"not longer than train.ttt.steps {cfg.train.ttt.steps})",
        )
    words = "the largest power of two not longer than half of them" + (
        f", at most {LARGEST_AUTO_WINDOW:,}" if size == LARGEST_AUTO_WINDOW else ""
    )
    return WindowChoice(size, f"auto: {size:,} ({served.words}, {ratio:.0f}x the training {described}; {words})")

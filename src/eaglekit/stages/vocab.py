"""vocab: pick the draft vocabulary — the most frequent target tokens among the assistant tokens.

Reads ``prepare/tokens.safetensors``; writes ``vocab/vocab.safetensors`` with ``d2t`` (int64 [Vd],
``target_id = draft_id + d2t[draft_id]``) and ``t2d`` (bool [V]), the two buffers every EAGLE-3
checkpoint carries, and in its metadata what it was built from (the tokens' sha256 and the settings, which
train's pre-flight compares with the run's own), and ``vocab/stats.json`` with the coverage: the share of
assistant tokens the drafter can propose at all (an upper bound on its acceptance).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data.tokens import TokenStore
from eaglekit.data.vocab import PREPARED_TOKENS, VOCAB, built_from
from eaglekit.errors import EaglekitError
from eaglekit.hub import model_file
from eaglekit.preflight import fail, files, ok
from eaglekit.progress import console
from eaglekit.resolved import ResolvedRun

if TYPE_CHECKING:
    import torch

NAME = "vocab"
UPSTREAM = "prepare"


def params(run: ResolvedRun) -> dict:
    cfg = run.cfg
    return cfg.vocab.model_dump() | files.read_identities(cfg, "tokens")


def target_vocab_size(model: str) -> int:
    """The vocab size in ``target.model``'s config.json: a folder, or a hub id's snapshot in the local cache."""
    path = model_file(model, "config.json")
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise EaglekitError(f"{path} has no vocab_size", "point target.model at a causal LM folder")
    return int(size)


def draft_vocab_fits(ctx: StageContext):
    try:
        v = target_vocab_size(ctx.cfg.target.model)
    except EaglekitError as err:
        return fail("draft vocab size", f"cannot read the target's vocab size: {err.message}", err.remedy or "")
    except (OSError, ValueError) as err:
        return fail("draft vocab size", f"cannot read the target's vocab size: {err}", "check target.model")
    vd = ctx.cfg.vocab.draft_vocab_size
    if vd > v:
        return fail(
            "draft vocab size",
            f"vocab.draft_vocab_size {vd} exceeds the target's vocab size {v}",
            f"set vocab.draft_vocab_size ≤ {v}",
        )
    return ok("draft vocab size", f"{vd} of {v} target tokens")


def checks(cfg: RunConfig) -> list:
    return [draft_vocab_fits]


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    size = ctx.cfg.vocab.draft_vocab_size
    est = Estimate(bytes=size * 8 + (4 << 20), how=[f"d2t {size:,.0f} × 8 B + t2d and stats"])
    if sizes is not None:
        measured_time(est, sizes, "samples")
    return est


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, int]:
    """The ``draft_vocab_size`` most frequent ids, sorted by id; fills with the lowest unused ids when
    fewer distinct tokens occur. Returns (selected ids, number of fill ids)."""
    import torch  # lazy: heavy (torch)

    seen = int((counts > 0).sum())
    top = torch.argsort(counts, descending=True, stable=True)[: min(seen, draft_vocab_size)]
    fill = draft_vocab_size - top.numel()
    if fill:
        unused = torch.ones_like(counts, dtype=torch.bool)
        unused[top] = False
        top = torch.cat([top, unused.nonzero().flatten()[:fill]])
    return torch.sort(top).values, fill


def run(ctx: StageContext) -> dict:
    import torch  # lazy: heavy (torch)
    from safetensors.torch import save_file  # lazy: heavy (torch)

    from eaglekit.model.draft_vocab import build_d2t_t2d  # lazy: heavy (torch)

    cfg = ctx.cfg
    store = TokenStore(ctx.run.path / PREPARED_TOKENS)
    # kept in the file, so a copy elsewhere is told from its own (the settings, without params' tokens hash)
    origin = built_from(ctx.run.path, cfg.vocab.model_dump())
    vocab_size = target_vocab_size(cfg.target.model)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(store)):
        _, ids, mask = store[i]
        ids = ids[mask.bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise EaglekitError(
                f"prepare's tokens hold id {int(ids.max())} ≥ the target's vocab size {vocab_size}",
                "the tokenizer does not match target.model; rerun prepare with the right tokenizer",
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    selected, fill = select_draft_vocab(counts, cfg.vocab.draft_vocab_size)
    d2t, t2d = build_d2t_t2d(selected, vocab_size)
    total = int(counts.sum())
    covered = int(counts[t2d].sum())
    coverage = covered / total if total else 0.0
    with atomic.atomic_path(ctx.dir / VOCAB) as tmp:
        save_file(
            {"d2t": d2t, "t2d": t2d},
            str(tmp),
            metadata={
                "draft_vocab_size": str(len(selected)),
                "vocab_size": str(vocab_size),
                "built_from": json.dumps(origin),
            },
        )
    stats = {
        "draft_vocab_size": len(selected),
        "target_vocab_size": vocab_size,
        "distinct_assistant_tokens": int((counts > 0).sum()),
        "assistant_tokens": total,
        "coverage": round(coverage, 6),
        "filled_with_unused_ids": fill,
        "built_from": origin,
    }
    atomic.write_json(ctx.dir / "stats.json", stats)
    console.print(f"vocab: {len(selected)} draft tokens cover {coverage:.2%} of {total} assistant tokens")
    if fill:
        console.print(
            f"[yellow]vocab: only {stats['distinct_assistant_tokens']} distinct tokens occur; "
            f"filled {fill} slots with the lowest unused ids[/]"
        )
    return {"draft_vocab_size": len(selected), "coverage": round(coverage, 4), "filled": fill}


def continues(ctx: StageContext) -> str | None:
    """Only the prepared tokens changed since the vocabulary in the folder was counted (prepare went on with more or
    fewer samples): counting them again is cheap and replaces nothing finished that the new tokens leave valid."""
    if not files.changed_only(ctx, ("tokens",)):
        return None
    return "the prepared tokens changed since it ran: the vocabulary is counted again from them"


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="prepare/tokens.safetensors",
    writes="vocab/vocab.safetensors (d2t, t2d), vocab/stats.json",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
    continues=continues,
)

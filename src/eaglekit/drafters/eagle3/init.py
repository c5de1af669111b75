"""The drafter a run starts from: fresh from the target's config, or a published drafter (``train.init_from``).

A fresh drafter takes the target's shapes (``train.draft`` overrides), its frozen embedding and — when the widths
match — the target's lm_head rows of the draft vocabulary. A finetuned one keeps its own vocabulary unless
``train.remap_vocab`` maps it onto this run's. ``train.freeze_lm_head`` then decides whether the head trains.
"""

from __future__ import annotations

import dataclasses

import torch

from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.hub import drafter_folder
from eaglekit.serving.engine_features import check_published
from eaglekit.training.distributed import say


def new_drafter(
    cfg,
    hf_config,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    embed: torch.Tensor,
    head: torch.Tensor,
    aux_ids: list[int],
    settings: dict,
) -> Eagle3Drafter:
    """A drafter shaped after the target (``settings``: train.draft as its family reads it), with the target's
    embedding frozen in."""
    dcfg = DrafterConfig.from_target_config(
        hf_config, draft_vocab_size=int(d2t.numel()), aux_layer_ids=aux_ids, **settings
    )
    drafter = Eagle3Drafter(dcfg)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    take_target_embedding(drafter, embed)
    if cfg.train.init_lm_head_from_target:
        if head.shape[1] == dcfg.hidden_size:
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head[t2d.to(head.device)])
        else:
            say(
                f"[yellow]train: lm_head starts random: the target's rows are {head.shape[1]} wide, "
                f"the drafter's hidden size is {dcfg.hidden_size}[/]"
            )
    return drafter


def take_target_embedding(drafter: Eagle3Drafter, embed: torch.Tensor) -> None:
    """EAGLE-3 embeds tokens with the target's (frozen) embedding; a drafter of another width must learn its own."""
    if tuple(embed.shape) == tuple(drafter.embed_tokens.weight.shape):
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed)
        drafter.embed_tokens.weight.requires_grad_(False)
    else:
        say(
            f"[yellow]train: the target's embedding is {list(embed.shape)}, the drafter's "
            f"{list(drafter.embed_tokens.weight.shape)}: the drafter trains its own embedding[/]"
        )
        drafter.embed_tokens.weight.requires_grad_(True)


def remap_vocab(
    drafter: Eagle3Drafter, d2t: torch.Tensor, t2d: torch.Tensor, head: torch.Tensor | None
) -> tuple[Eagle3Drafter, int]:
    """The drafter on a new draft vocab: lm_head rows of tokens in both vocabs keep their weights, new rows come
    from the target's lm_head (when the widths match) or zero. Returns (new drafter, number of new rows)."""
    old_t2d = drafter.t2d.cpu()
    old_row = torch.cumsum(old_t2d.long(), 0) - 1  # draft row of each target id that the old vocab holds
    new_ids = t2d.nonzero().squeeze(1)
    cfg = dataclasses.replace(drafter.config, draft_vocab_size=int(new_ids.numel()))
    out = Eagle3Drafter(cfg)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    out.load_state_dict(state, strict=False)
    out.embed_tokens.weight.requires_grad_(drafter.embed_tokens.weight.requires_grad)
    kept = old_t2d[new_ids]
    with torch.no_grad():
        w = out.lm_head.weight
        if head is not None and head.shape[1] == w.shape[1]:
            w.copy_(head[new_ids])
        else:
            w.zero_()
        w[kept] = drafter.lm_head.weight.detach().cpu()[old_row[new_ids[kept]]]
        out.d2t.copy_(d2t)
        out.t2d.copy_(t2d)
    return out, int((~kept).sum())


def build_drafter(cfg, hf_config, d2t, t2d, embed, head, aux_ids, settings: dict) -> tuple[Eagle3Drafter, dict]:
    """Fresh (shaped by ``settings``), or ``train.init_from`` (its own d2t/t2d unless ``train.remap_vocab``); also
    says where the vocab came from."""
    if not cfg.train.init_from:
        drafter = new_drafter(cfg, hf_config, d2t, t2d, embed, head, aux_ids, settings)
        has_rows = cfg.train.init_lm_head_from_target and head.shape[1] == drafter.config.hidden_size
        return drafter, {"draft_vocab": "vocab stage", "lm_head": freeze_head(drafter, cfg, has_rows)}
    check_published(drafter_folder(cfg.train.init_from), say, cfg.verify.python)  # SpecForge#879, engine drops
    drafter, _info = eagle3_checkpoint.load_drafter(
        drafter_folder(cfg.train.init_from)
    )  # a hub id: pre-flight fetched it
    drafter = drafter.float()
    if cfg.train.remap_vocab:
        drafter, new_rows = remap_vocab(drafter, d2t, t2d, head if cfg.train.init_lm_head_from_target else None)
        say(
            f"train: finetuning {cfg.train.init_from} on this run's draft vocab: {new_rows} of "
            f"{int(d2t.numel())} lm_head rows are new (from the target's lm_head, or zero), the rest keep their weights"
        )
        notes = {"draft_vocab": "vocab stage (remapped)", "new_lm_head_rows": new_rows}
        has_rows = new_rows == 0 or (cfg.train.init_lm_head_from_target and head.shape[1] == drafter.config.hidden_size)
    else:
        say(
            f"train: finetuning {cfg.train.init_from} with its own draft vocab ({drafter.config.draft_vocab_size} "
            "tokens); the vocab stage's mapping is not used (train.remap_vocab: true maps onto it)"
        )
        notes = {"draft_vocab": "init_from checkpoint"}
        has_rows = True
    take_target_embedding(drafter, embed)
    notes["lm_head"] = freeze_head(drafter, cfg, has_rows)
    return drafter, notes


def freeze_head(drafter: Eagle3Drafter, cfg, has_rows: bool) -> str:
    """train.freeze_lm_head: the draft head stays at the rows it starts from, when it has some ("frozen"), else
    it trains ("trained"). Trained, on the τ race against speculators (benchmarks/results/tau-race.md), it drifted 38 %
    from the target's rows and cost 11 % of τ at K=5; frozen, the layer learns to speak the target's head.
    A head that starts random or zero must train, whatever the setting."""
    frozen = cfg.train.freeze_lm_head and has_rows
    drafter.lm_head.weight.requires_grad_(not frozen)
    if cfg.train.freeze_lm_head and not has_rows:
        say(
            "[yellow]train: lm_head trains although train.freeze_lm_head is set: it has no rows to start from "
            "(the target's lm_head is another width, or train.init_lm_head_from_target is false)[/]"
        )
    return "frozen" if frozen else "trained"

"""The DFlash2 race (issue 44): eaglekit's DFlash2 trainer against speculators 0.9.0's own DFlash2 model, loss and
trainer.

dflash_vs_speculators.py's design (benchmarks/race_common.py) for DFlash2: DFlash with a grouped dynamic
convolution around every sublayer (along the block, causal in it) and a predecessor-conditioned selector that
re-ranks each mask slot's top-K candidates. Same data, same drafter shape, same step budget; each trainer otherwise
as it ships. Both drafters are then measured by eaglekit's DFlash2 decoding (drafters/dflash2/proposer.py: DFlash's
block of K+1 queries, drafts along the selector's greedy path, as vLLM's V2 runner drafts at T=0).

  data         dflash_vs_speculators.py's: --steps batches of --batch rows of the tiny target's train split in a
               seeded order, the target's features of each batch computed once and given to both sides.
  eaglekit     DFlash2Drafter + the block objective (drafters/dflash/objective.py) with the selector's K-way
               cross-entropy added at weight 1 (DFlash2Drafter.extra_slot_loss, weighted over the slots as the
               block's CE); the train stage's AdamW settings (train.adam_betas, weight decay, clip).
  speculators  in its own venv: DFlash2DraftModel.from_training_args, its collate, get_trainer_kwargs (loss
               "ce", D-PACE, selector_loss_alpha 1) and Trainer (AdamW 0.9/0.999, weight decay 0.01, clip 1.0);
               dflash_vs_speculators.py's CPU adaptations.
  matched      layers --layers, block --block, convolution taps 2 and groups of 16 channels, selector top 16
               (speculators' defaults) at rank --selector-rank (its default 256, twice the tiny target's width, costs
               the CPU 5x DSpark's step on both sides), the mask token, max anchors --anchors, D-PACE alpha 0.5, the
               full vocabulary, embedding and head frozen at the target's, lr constant, the steps and rows.
  differs      the optimizer settings and clip; anchors and blocks past a document's end as in the DFlash race;
               the selector's predecessor in training: speculators conditions slot k on the row's own token before
               it, eaglekit on the target's argmax there (the token an accepted path holds).
  measure      speculators' saved checkpoint loaded into eaglekit's DFlash2Drafter (same weight names; keys and
               shapes checked), after a check that its forward and eaglekit's give the same logits and selector
               scores on a real block; then τ per K at T=0 on --prompts held-out prompts, 96 new tokens.

    .venv/bin/python benchmarks/dflash2_vs_speculators.py --steps 5 --seeds 1      # smoke
    .venv/bin/python benchmarks/dflash2_vs_speculators.py                          # 3 seeds

It needs benchmarks/.venv-speculators (bash benchmarks/setup_speculators.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]  # also when loaded from a file (a test)

from race_common import (  # noqa: E402
    Race,
    arguments,
    block_context,
    checked,
    eaglekit_block_hidden,
    load_block_drafter,
    logit_check,
    run_child,
    speculators_block_child,
    speculators_block_layer,
    train_block_eaglekit,
)


def speculators_child(job: dict) -> None:
    """Runs in benchmarks/.venv-speculators: speculators' own DFlash2 model, collate, loss and Trainer."""
    speculators_block_child(job, speculators_model(job), forward_check, selector_loss_alpha=1.0)


def speculators_model(job: dict):
    """speculators' DFlash2DraftModel as its CLI builds it (``from_training_args``): the race's layer config, the
    full verifier vocabulary (DFlash2 requires it), its default convolution and selector."""
    from speculators.models.dflash2 import DFlash2DraftModel

    hf, layer = speculators_block_layer(job)
    model = DFlash2DraftModel.from_training_args(
        verifier_config=layer,
        verifier_name_or_path=job["target"],
        target_layer_ids=job["aux"],
        draft_vocab_size=hf.vocab_size,
        block_size=job["block"],
        mask_token_id=job["mask_token_id"],
        selector_rank=job["selector_rank"],
        draft_attn_impl="eager",  # flex attention has no CPU backward
    )
    assert not model.config.sample_from_anchor, "DFlash2's anchor slot holds the verified token (its default)"
    assert not model.uses_sliding_window_attn, "every draft layer must be full attention (vLLM's and eaglekit's)"
    return model


def forward_check(model, batch: dict, job: dict) -> dict:
    """Speculators' own layers (convolutions included) and selector, and eaglekit's DFlash2Drafter with its saved
    weights, on one block as served (race_common.block_context): the logits of every slot, and the selector's scores
    of each mask slot's top-K given the row's token before it. Returns the largest difference of either and whether
    the drafts agree (argmax and the selector's pick)."""
    import torch

    from eaglekit.model.target import embedding_and_head

    embed, head = embedding_and_head(job["target"])
    ours = load_speculators_drafter(Path(job["out"]) / "final", embed, head)
    hidden, queries, n, aux = block_context(model, batch, job)
    previous = batch["input_ids"][0, n - 1 : n - 1 + job["block"]]
    with torch.no_grad():
        theirs = model.lm_head(hidden)[0].float()
        mine_hidden = eaglekit_block_hidden(ours, queries, n, aux)[0]
        mine = ours.logits(mine_hidden)
        candidates = theirs.topk(model.candidate_selector.top_k, dim=-1).indices
        their_scores = model.candidate_selector.score_candidates(theirs, hidden[0], previous, candidates)
        my_scores = ours.candidate_selector.scores(mine, mine_hidden, previous, candidates)
    logits = logit_check(theirs, mine, slice(1, None))
    scores = logit_check(their_scores[:, None], my_scores[:, None], slice(0, None))
    return {
        "max_abs_logit_diff": max(logits["max_abs_logit_diff"], scores["max_abs_logit_diff"]),
        "same_drafts": logits["same_drafts"] and bool(torch.equal(their_scores.argmax(-1), my_scores.argmax(-1))),
    }


def load_speculators_drafter(folder: Path, embed, head):
    """speculators' saved DFlash2 checkpoint as eaglekit's DFlash2Drafter: DFlash's keys, each layer's
    convolutions and the selector's (eaglekit's names); its config's convolution and selector settings."""
    from eaglekit.drafters.dflash2.checkpoint import expected_state
    from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter

    own = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return load_block_drafter(folder, embed, head, DFlash2Config, DFlash2Drafter, own, expected_state)


def main() -> None:
    p = arguments(__doc__, "dflash2_vs_speculators")
    p.add_argument("--layers", type=int, default=2, help="draft layers (speculators' default 5)")
    p.add_argument("--block", type=int, default=8, help="block size (speculators' default 16)")
    p.add_argument("--anchors", type=int, default=512, help="max anchors per step's sequence (speculators' default)")
    p.add_argument(
        "--selector-rank",
        type=int,
        default=64,
        help="the selector's rank (speculators' default 256: twice the tiny target's width)",
    )
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if max(args.ks) > args.block - 1:
        sys.exit(f"--ks {max(args.ks)}: a block of {args.block} drafts at most {args.block - 1} tokens")

    import torch

    from eaglekit.drafters.dflash2.family import DEFAULT_SELECTOR_LOSS_WEIGHT
    from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter

    race = Race(args)

    def eaglekit_side(batches: list[dict], seed: int) -> dict:
        torch.manual_seed(seed)
        config = DFlash2Config.from_target_config(
            race.target.config,
            race.aux,
            race.mask_token_id,
            num_hidden_layers=args.layers,
            block_size=args.block,
            shared_k_norm=False,  # speculators' layers each have their own k_norm
            selector_rank=args.selector_rank,
        )
        drafter = DFlash2Drafter(config)
        drafter.take_target(race.embed, race.head)
        seconds, loss = train_block_eaglekit(drafter, batches, args, seed, DEFAULT_SELECTOR_LOSS_WEIGHT)
        return {"train_s": round(seconds, 1), "tail_loss": round(loss, 4), "k": race.measured(drafter)}

    def speculators_side(job: dict) -> dict:
        job |= {
            "layers": args.layers,
            "block": args.block,
            "anchors": args.anchors,
            "selector_rank": args.selector_rank,
        }
        seconds = run_child(__file__, job, args)
        summary = json.loads((Path(job["out"]) / "summary.json").read_text())
        check = checked(summary)
        drafter = load_speculators_drafter(Path(job["out"]) / "final", race.embed, race.head)
        return {"train_s": round(seconds, 1), "tail_loss": round(summary["tail_loss"], 4)} | {
            "forward_check": check,
            "k": race.measured(drafter),
        }

    title = f"DFlash2 ({args.layers} layers, block {args.block}, max anchors {args.anchors}, rank {args.selector_rank})"
    race.run(title, eaglekit_side, speculators_side)


if __name__ == "__main__":
    main()

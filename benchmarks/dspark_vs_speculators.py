"""The DSpark race (issue 44): eaglekit's DSpark trainer against speculators 0.9.0's own DSpark model, loss and trainer.

dflash_vs_speculators.py's design (benchmarks/race_common.py) for DSpark: DFlash's backbone drafting from the
anchor (every slot of a block drafts, the anchor's included) plus a low-rank Markov head whose bias for slot k is
read from the token at slot k's own position. Same data, same drafter shape, same step budget; each trainer
otherwise as it ships. Both drafters are then measured by eaglekit's DSpark decoding (drafters/dspark/proposer.py,
vLLM's DSparkSpeculator at T=0: K queries, drafted left to right with the Markov bias of the previous draft).

  data         dflash_vs_speculators.py's: --steps batches of --batch rows of the tiny target's train split in a
               seeded order, the target's features of each batch computed once and given to both sides.
  eaglekit     DSparkDrafter + the block objective (drafters/dflash/objective.py: anchors per row, per-document
               blocks, CE on the target's argmax at every slot from the anchor's, the Markov bias teacher-forced
               from the row's tokens, D-PACE); the train stage's AdamW settings (train.adam_betas, weight decay, clip).
  speculators  in its own venv: DSparkDraftModel.from_training_args (sample_from_anchor, its default), its
               collate, get_trainer_kwargs (loss "ce", D-PACE) and Trainer (AdamW 0.9/0.999, weight decay 0.01,
               clip 1.0); dflash_vs_speculators.py's CPU adaptations.
  matched      layers --layers, block --block, Markov rank --markov-rank (speculators' default 256) with its
               vanilla head, the mask token, max anchors --anchors (its DSpark default 3072: changed, for the CPU
               budget), D-PACE alpha 0.5, the full vocabulary, embedding and head frozen at the target's, lr
               constant, the steps and rows. speculators' confidence head (an acceptance estimate only vLLM's
               adaptive verification reads; its BCE loss also reaches the backbone) is off
               (enable_confidence_head false): eaglekit trains none.
  differs      the optimizer settings and clip; anchors as in the DFlash race (speculators per packed sequence,
               never in its last block; eaglekit per row); a block past its document's end (speculators keeps
               counting into the next packed document, eaglekit stops).
  measure      speculators' saved checkpoint loaded into eaglekit's DSparkDrafter (same weight names; keys and
               shapes checked), after a check that its forward and eaglekit's give the same logits (backbone plus
               Markov bias) on a real block; then τ per K at T=0 on --prompts held-out prompts, 96 new tokens.

    .venv/bin/python benchmarks/dspark_vs_speculators.py --steps 5 --seeds 1       # smoke
    .venv/bin/python benchmarks/dspark_vs_speculators.py                           # 3 seeds

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
    """Runs in benchmarks/.venv-speculators: speculators' own DSpark model, collate, loss and Trainer."""
    speculators_block_child(job, speculators_model(job), forward_check)


def speculators_model(job: dict):
    """speculators' DSparkDraftModel as its CLI builds it (``from_training_args``): the race's layer config, the full
    verifier vocabulary, its vanilla Markov head at --markov-rank, no confidence head."""
    from speculators.models.dspark import DSparkDraftModel

    hf, layer = speculators_block_layer(job)
    model = DSparkDraftModel.from_training_args(
        verifier_config=layer,
        verifier_name_or_path=job["target"],
        target_layer_ids=job["aux"],
        draft_vocab_size=hf.vocab_size,
        block_size=job["block"],
        mask_token_id=job["mask_token_id"],
        markov_rank=job["markov_rank"],
        markov_head_type="vanilla",
        enable_confidence_head=False,
        confidence_head_with_markov=False,
        draft_attn_impl="eager",  # flex attention has no CPU backward
    )
    assert model.config.sample_from_anchor, "DSpark drafts from the anchor (speculators' and vLLM's default)"
    assert not model.uses_sliding_window_attn, "every draft layer must be full attention (vLLM's and eaglekit's)"
    return model


def forward_check(model, batch: dict, job: dict) -> dict:
    """Speculators' own layers and Markov head, and eaglekit's DSparkDrafter with its saved weights, on one block as
    served (race_common.block_context), each slot's bias from the row's own token at its position. Returns the
    largest logit difference and whether the drafts agree (every slot drafts)."""
    import torch

    from eaglekit.model.target import embedding_and_head

    embed, head = embedding_and_head(job["target"])
    ours = load_speculators_drafter(Path(job["out"]) / "final", embed, head)
    hidden, queries, n, aux = block_context(model, batch, job)
    previous = batch["input_ids"][:1, n - 1 : n - 1 + job["block"]]
    with torch.no_grad():
        theirs = model.lm_head(hidden) + model.markov_head.block_bias(prev_token_ids=previous, hidden_states=hidden)
        mine = ours.logits(eaglekit_block_hidden(ours, queries, n, aux)) + ours.slot_bias(previous)
    return logit_check(theirs[0], mine[0], slice(0, None))


def load_speculators_drafter(folder: Path, embed, head):
    """speculators' saved DSpark checkpoint as eaglekit's DSparkDrafter: DFlash's keys and the Markov head's
    (``markov_head.markov_w1/w2.weight``, eaglekit's names); its config's markov_rank."""
    from eaglekit.drafters.dspark.checkpoint import expected_state
    from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter

    c = json.loads((folder / "config.json").read_text())
    if c.get("markov_head_type", "vanilla") != "vanilla" or c.get("sample_from_anchor") is False:
        raise RuntimeError(f"{folder}: eaglekit's DSpark has the vanilla head and drafts from the anchor: {c}")
    return load_block_drafter(folder, embed, head, DSparkConfig, DSparkDrafter, ("markov_rank",), expected_state)


def main() -> None:
    p = arguments(__doc__, "dspark_vs_speculators")
    p.add_argument("--layers", type=int, default=2, help="draft layers (speculators' default 5)")
    p.add_argument("--block", type=int, default=8, help="block size (speculators' default 16)")
    p.add_argument("--anchors", type=int, default=512, help="max anchors per step's sequence (DSpark's 3072)")
    p.add_argument("--markov-rank", type=int, default=256, help="the Markov head's rank (speculators' default)")
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if max(args.ks) > args.block:
        sys.exit(f"--ks {max(args.ks)}: a DSpark block of {args.block} drafts at most {args.block} tokens")

    import torch

    from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter

    race = Race(args)

    def eaglekit_side(batches: list[dict], seed: int) -> dict:
        torch.manual_seed(seed)
        config = DSparkConfig.from_target_config(
            race.target.config,
            race.aux,
            race.mask_token_id,
            num_hidden_layers=args.layers,
            block_size=args.block,
            shared_k_norm=False,  # speculators' layers each have their own k_norm
            markov_rank=args.markov_rank,
        )
        drafter = DSparkDrafter(config)
        drafter.take_target(race.embed, race.head)
        seconds, loss = train_block_eaglekit(drafter, batches, args, seed)
        return {"train_s": round(seconds, 1), "tail_loss": round(loss, 4), "k": race.measured(drafter)}

    def speculators_side(job: dict) -> dict:
        job |= {"layers": args.layers, "block": args.block, "anchors": args.anchors, "markov_rank": args.markov_rank}
        seconds = run_child(__file__, job, args)
        summary = json.loads((Path(job["out"]) / "summary.json").read_text())
        check = checked(summary)
        drafter = load_speculators_drafter(Path(job["out"]) / "final", race.embed, race.head)
        return {"train_s": round(seconds, 1), "tail_loss": round(summary["tail_loss"], 4)} | {
            "forward_check": check,
            "k": race.measured(drafter),
        }

    title = f"DSpark ({args.layers} layers, block {args.block}, Markov rank {args.markov_rank}, anchors {args.anchors})"
    race.run(title, eaglekit_side, speculators_side)


if __name__ == "__main__":
    main()

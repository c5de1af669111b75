"""The DFlash race (issue 21): eaglekit's DFlash trainer against speculators 0.9.0's own DFlash model, loss and trainer.

Same data, same drafter shape, same step budget; each trainer otherwise as it ships. Both drafters are then
measured by eaglekit's block decoding (speculative/block.py, vLLM's DFlash proposer) on the same prompts.

  data         dflash_vs_eagle3.py's: the tiny target's task corpus (train split) rendered with its chat template,
               loss on the assistant turn; --steps batches of --batch rows picked in a seeded order. The target's
               features of each batch are computed once (eaglekit's TargetFeatures, aux layers [2, 4, 5]) and
               given to both sides: the same rows, features and order at every step.
  eaglekit     DFlashDrafter + training/block.py's block_loss (random anchors, per-document blocks, CE on the
               target's argmax, D-PACE), padded rows; the train stage's AdamW settings (train.adam_betas, weight decay, clip).
  speculators  in its own venv (benchmarks/.venv-speculators): DFlashDraftModel.from_training_args, its collate
               (the batch's rows packed into one sequence with document ids), get_trainer_kwargs (loss "ce",
               D-PACE) and its Trainer (AdamW betas 0.9/0.999, weight decay 0.01, clip 1.0). Its verifier targets
               come from the final decoder layer's output before the norm (it applies the verifier's norm and head).
               CPU adaptations, as tau_vs_speculators.py's: device "cpu" (its trainer moves models to
               cuda:LOCAL_RANK), its step profiler off (it synchronizes an accelerator), eager attention (flex
               attention has no CPU backward) and the eager loss (the fused ones need Triton).
  matched      layers --layers and block --block (its defaults 5 and 16: changed, for the CPU budget), the
               target's layer shape (intermediate 256), one k_norm per layer (speculators' layers; eaglekit's
               shared_k_norm off), the mask token (eaglekit's default_mask_token_id, passed as its
               mask_token_id), max anchors --anchors, D-PACE alpha 0.5, the full verifier vocabulary, embedding
               and head frozen at the target's, lr --lr constant (its scheduler default "linear" changed to
               "none"), the steps and the rows of each step.
  differs      the optimizer settings and clip above; initialisation (speculators: normal(0.02), eaglekit:
               torch's default); anchors: speculators draws --anchors per packed sequence and never in its last
               block, eaglekit per row (a row has fewer loss tokens than --anchors, so every one); a block that
               runs past its document's end keeps counting in speculators (into the next packed document, whose
               first tokens are outside the loss mask), eaglekit stops at the end.
  measure      speculators' saved checkpoint loaded into eaglekit's DFlashDrafter (its weight names are the
               same; the key set and shapes are checked), after a check that its own forward and eaglekit's give
               the same logits on a real block; then dflash_vs_eagle3.py's measure: --prompts held-out prompts,
               96 new tokens, temperature 0, τ (tokens per target pass) per K and acceptance per draft position.

    .venv/bin/python benchmarks/dflash_vs_speculators.py --steps 5 --seeds 1      # smoke, ~2 min
    .venv/bin/python benchmarks/dflash_vs_speculators.py                          # 3 seeds, ~35 min on one core
    .venv/bin/python benchmarks/dflash_vs_speculators.py --no-speculators --eaglekit-optimizer speculators
                                    # eaglekit's side alone with speculators' AdamW settings and clip (~5 min)

--seeds N trains each side N times (seeds --first-seed onwards; each seed also picks the batches' order) and reports
the mean and a 95 % bootstrap interval over seeds per K for each side and for the ratio. A side that fails is reported
as failed and the race goes on. It needs benchmarks/.venv-speculators (bash benchmarks/setup_speculators.sh). What
every race shares (data, child, measure, report) is benchmarks/race_common.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]  # also when loaded from a file (the bridge test)

from race_common import (  # noqa: E402, F401  (batch_features: the bridge test's)
    Race,
    arguments,
    batch_features,
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


def dflash_config(target_config, aux: list[int], mask_token_id: int, args):
    from eaglekit.drafters.dflash.model import DFlashConfig

    return DFlashConfig.from_target_config(
        target_config, aux, mask_token_id, num_hidden_layers=args.layers, block_size=args.block, shared_k_norm=False
    )


# ---------------------------------------------------------------------------------------- speculators' side


def speculators_child(job: dict) -> None:
    """Runs in benchmarks/.venv-speculators: speculators' own DFlash model, collate, loss and Trainer."""
    speculators_block_child(job, speculators_model(job), forward_check)


def speculators_model(job: dict):
    """speculators' DFlashDraftModel as its CLI builds it (``from_training_args``), on a Qwen3 layer config of the
    target's shape with --layers layers, the full verifier vocabulary (no t2d / d2t) and the race's mask token."""
    from speculators.models.dflash import DFlashDraftModel

    hf, layer = speculators_block_layer(job)
    model = DFlashDraftModel.from_training_args(
        verifier_config=layer,
        verifier_name_or_path=job["target"],
        target_layer_ids=job["aux"],
        draft_vocab_size=hf.vocab_size,
        block_size=job["block"],
        mask_token_id=job["mask_token_id"],
        draft_attn_impl="eager",  # flex attention has no CPU backward
    )
    assert not model.uses_sliding_window_attn, "every draft layer must be full attention (vLLM's and eaglekit's)"
    return model


def forward_check(model, batch: dict, job: dict) -> dict:
    """Speculators' own layers and eaglekit's DFlashDrafter with its saved weights on one block as served
    (race_common.block_context). Returns the largest logit difference and whether the drafts agree."""
    from eaglekit.model.target import embedding_and_head

    embed, head = embedding_and_head(job["target"])
    ours = load_speculators_drafter(Path(job["out"]) / "final", embed, head)
    hidden, queries, n, aux = block_context(model, batch, job)
    theirs = model.lm_head(hidden).float()
    mine = ours.logits(eaglekit_block_hidden(ours, queries, n, aux))
    return logit_check(theirs[0], mine[0], slice(1, None))


def load_speculators_drafter(folder: Path, embed, head):
    """speculators' saved DFlash checkpoint as eaglekit's DFlashDrafter (race_common.load_block_drafter)."""
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter

    return load_block_drafter(folder, embed, head, DFlashConfig, DFlashDrafter)


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = arguments(__doc__, "dflash_vs_speculators")
    p.add_argument("--layers", type=int, default=2, help="draft layers (speculators' default 5)")
    p.add_argument("--block", type=int, default=8, help="block size (speculators' default 16)")
    p.add_argument("--anchors", type=int, default=512, help="max anchors per step's sequence (speculators' default)")
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if max(args.ks) > args.block - 1:
        sys.exit(f"--ks {max(args.ks)}: a block of {args.block} drafts at most {args.block - 1} tokens")

    import torch

    from eaglekit.drafters.dflash.model import DFlashDrafter

    race = Race(args)

    def eaglekit_side(batches: list[dict], seed: int) -> dict:
        torch.manual_seed(seed)
        drafter = DFlashDrafter(dflash_config(race.target.config, race.aux, race.mask_token_id, args))
        drafter.take_target(race.embed, race.head)
        seconds, loss = train_block_eaglekit(drafter, batches, args, seed)
        return {"train_s": round(seconds, 1), "tail_loss": round(loss, 4), "k": race.measured(drafter)}

    def speculators_side(job: dict) -> dict:
        job |= {"layers": args.layers, "block": args.block, "anchors": args.anchors}
        seconds = run_child(__file__, job, args)
        summary = json.loads((Path(job["out"]) / "summary.json").read_text())
        check = checked(summary)
        drafter = load_speculators_drafter(Path(job["out"]) / "final", race.embed, race.head)
        return {"train_s": round(seconds, 1), "tail_loss": round(summary["tail_loss"], 4)} | {
            "forward_check": check,
            "k": race.measured(drafter),
        }

    race.run(
        f"DFlash ({args.layers} layers, block {args.block}, max anchors {args.anchors})",
        eaglekit_side,
        speculators_side,
    )


if __name__ == "__main__":
    main()

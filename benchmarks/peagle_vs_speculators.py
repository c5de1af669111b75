"""The P-EAGLE race (issue 44): eaglekit's P-EAGLE trainer against speculators 0.9.0's own P-EAGLE model, loss and
trainer.

dflash_vs_speculators.py's design (benchmarks/race_common.py) for P-EAGLE: EAGLE-3's one Llama layer drafting all
K tokens in one pass, K-1 of them at parallel slots (the slot token and a learned mask_hidden for the target's
states). Same data, same drafter shape, same step budget; each trainer otherwise as it ships. Both drafters are then
measured by eaglekit's P-EAGLE decoding (drafters/peagle/proposer.py: one causal pass over the verified positions
and K-1 slots, as vLLM drafts with parallel_drafting at T=0).

  data         dflash_vs_speculators.py's: --steps batches of --batch rows of the tiny target's train split in a
               seeded order, the target's features of each batch computed once and given to both sides.
  eaglekit     PEagleDrafter + training-time test whose step d is parallel slot d (drafters/eagle3/ttt.py through
               PEagleDrafter.draft_step_input): every chain trained at every depth 0..--depths-1, depth d weighted
               0.8^d (train.ttt's defaults), soft cross-entropy against the target's distribution; padded rows;
               the train stage's AdamW settings (train.adam_betas, weight decay, clip).
  speculators  in its own venv: PEagleDraftModel.from_training_args, its collate with shift_batch (its CLI's
               preprocess for peagle), get_trainer_kwargs (loss kl_div, COD sampling: depth d keeps
               max(0.7^d, 0.2) of the chains, every kept element weighing the same) and its Trainer (AdamW
               0.9/0.999, weight decay 0.01, clip 1.0); dflash_vs_speculators.py's CPU adaptations, and one of
               its eager mask: a padding row of the packed step, which may see no key, sees itself (flex attention
               gives such a row zeros; the eager mask gives NaN, which reached the loss: padding_sees_itself).
  matched      one layer of the target's shape (intermediate 256), fc_norm on and norm_output off (eaglekit's
               P-EAGLE defaults; speculators' fc_norm default off: changed), norm_before_residual off, the slot
               token (eaglekit's default_mask_token_id), --depths parallel depths trained (speculators' default 8:
               7 here, the drafts of K=7), the full vocabulary, embedding and head frozen at the target's
               (speculators' P-EAGLE trains its embedding by default, embed_requires_grad: turned off, as eaglekit's
               drafter shares the target's), lr constant, the steps and the rows of each step.
  differs      the optimizer settings and clip; the depths' weights (eaglekit 0.8^d on every chain, speculators
               COD sampling); the loss mask (speculators counts a prediction where its input token is a loss
               token, eaglekit where the predicted one is); speculators' RoPE positions are the packed sequence's
               indices (relative, so the same attention).
  measure      speculators' saved checkpoint read by eaglekit's P-EAGLE reader (drafters/peagle/checkpoint.py,
               its speculators form) with the EAGLE 3.1 flags from its config's top level (where speculators writes
               them; vLLM reads them from transformer_layer_config only), after a check that its forward and
               eaglekit's give the same logits on a real parallel pass; then τ per K at T=0 on --prompts held-out
               prompts, 96 new tokens.

    .venv/bin/python benchmarks/peagle_vs_speculators.py --steps 5 --seeds 1      # smoke
    .venv/bin/python benchmarks/peagle_vs_speculators.py                          # 3 seeds

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
    checked,
    child_batches,
    child_loader,
    child_samples,
    child_train,
    logit_check,
    optimizer,
    run_child,
    tail_mean,
    write_summary,
)

FLAGS_TRAINED = {"fc_norm": True, "norm_output": False}  # eaglekit's P-EAGLE defaults, given to both sides


# ------------------------------------------------------------------------------------------- eaglekit's side


def eaglekit_drafter(target, aux: list[int], mask_token_id: int):
    """eaglekit's P-EAGLE drafter as peagle_vs_eagle3.py builds it: the target's layer shape, full vocabulary,
    the target's embedding and head (frozen)."""
    import torch

    from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter

    vocab = target.config.vocab_size
    drafter = PEagleDrafter(
        PEagleConfig.from_target_config(target.config, vocab, aux, mask_token_id=mask_token_id, **FLAGS_TRAINED)
    )
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    drafter.lm_head.weight.requires_grad_(False)
    return drafter


def train_eaglekit(drafter, target, batches: list[dict], args) -> tuple[float, float]:
    """Training-time test with parallel slots (drafters/eagle3/ttt.py) over the race's steps: (seconds, mean loss
    of the last tenth of the steps)."""
    import time

    import torch

    from eaglekit.config import TTTConfig
    from eaglekit.drafters.eagle3.ttt import ttt_loss
    from eaglekit.model.target import decoder_parts

    final_norm = decoder_parts(target)[2]
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim, clip = optimizer(params, args)
    weights = None if args.eaglekit_weights == "decay" else [max(0.7**d, 0.2) for d in range(args.depths)]
    settings = TTTConfig(steps=args.depths, step_weights=weights)
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        with torch.no_grad():
            logits = target.lm_head(final_norm(b["pre_norm"])).float()
        out = ttt_loss(
            drafter, b["aux"], b["input_ids"], logits, b["loss_mask"], b["attention_mask"], settings=settings
        )
        optim.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optim.step()
        losses.append(float(out.loss.detach()))
    return time.perf_counter() - t0, tail_mean(losses)


# ---------------------------------------------------------------------------------------- speculators' side


def speculators_child(job: dict) -> None:
    """Runs in benchmarks/.venv-speculators: speculators' own P-EAGLE model, collate (shift_batch), loss, Trainer."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.peagle import PEagleDraftModel

    batches = child_batches(job)
    samples, rows, packed = child_samples(batches)
    model = speculators_model(job)
    loader = child_loader(samples, rows, packed, len(batches), model.hidden_size, len(job["aux"]), shift_batch)
    train_kwargs, val_kwargs = PEagleDraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", num_depths=job["depths"]
    )
    summary = child_train(model, loader, train_kwargs, val_kwargs, job, len(batches))
    write_summary(job, summary | {"forward_check": forward_check(model, batches[0], job)})


def speculators_model(job: dict):
    """speculators' PEagleDraftModel as its CLI builds it (``from_training_args``): one Llama layer of the target's
    shape, the full verifier vocabulary, the race's flags, slot token and depths; its embedding frozen."""
    from speculators.models.peagle import PEagleDraftModel
    from tau_vs_speculators import draft_layer_shape
    from transformers import AutoConfig, LlamaConfig

    hf = AutoConfig.from_pretrained(job["target"])
    model = PEagleDraftModel.from_training_args(
        verifier_config=LlamaConfig(**draft_layer_shape(hf, hf.intermediate_size, layers=1)),
        verifier_name_or_path=job["target"],
        target_layer_ids=job["aux"],
        draft_vocab_size=hf.vocab_size,
        norm_before_residual=False,
        mask_token_id=job["mask_token_id"],
        num_depths=job["depths"],
        draft_attn_impl="eager",  # flex attention has no CPU backward
        **FLAGS_TRAINED,
    )
    model.config.embed_requires_grad = False  # the target's embedding, as eaglekit's drafter keeps it
    model.embed_tokens.weight.requires_grad_(False)
    model._create_mask_fn = padding_sees_itself(model._create_mask_fn)
    assert not model.uses_sliding_window_attn, "the draft layer must be full attention (eaglekit's here)"
    return model


def padding_sees_itself(create_float_mask):
    """A CPU adaptation of speculators' eager attention mask: a query row that may see nothing (a padding position of
    the packed step: its mask refuses every key) sees itself. Flex attention, what speculators runs on a GPU, gives
    such a row zeros; the eager float mask gives it -inf everywhere and the softmax NaN, which reaches the loss
    through 0 x NaN although the row is out of the loss mask. No real position ever sees a padding one (their
    documents differ), so what the row holds changes nothing else."""
    import torch

    def create(*args, **kwargs):
        mask = create_float_mask(*args, **kwargs)
        blind = torch.isinf(mask).all(-1)  # [B, H, Q]
        if blind.any():
            diagonal = torch.eye(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
            mask = mask.masked_fill(blind[..., None] & diagonal, 0.0)
        return mask

    return create


def forward_check(model, batch: dict, job: dict) -> dict:
    """speculators' own modules and eaglekit's PEagleDrafter read from its save, on one parallel pass as served: the
    first row's positions t < n (token t+1, the target's states at t) and --depths-1 slots (slot token,
    mask_hidden) after them, causal. Returns the largest logit difference and whether the drafts (the argmax at
    n-1 and at every slot) agree."""
    import torch

    from eaglekit.model.target import embedding_and_head

    embed, head = embedding_and_head(job["target"])
    ours = load_speculators_drafter(Path(job["out"]) / "final", embed, head)
    slots = job["depths"] - 1
    n = int(batch["attention_mask"][0].sum()) - 1
    aux = batch["aux"][0, :n]
    ids = torch.cat([batch["input_ids"][0, 1 : n + 1], torch.full((slots,), job["mask_token_id"])])[None]
    positions = torch.arange(n + slots)[None]
    model.eval()
    with torch.no_grad():
        states = torch.cat([aux, model.mask_hidden[0].expand(slots, -1)])[None]
        chunks = states.chunk(len(model.fc_norm), dim=-1)
        feature = model.fc(torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks, strict=True)], dim=-1))
        layer_input = torch.cat([model.embed_tokens(ids), feature], dim=-1)
        causal = torch.full((n + slots, n + slots), float("-inf")).triu(1)[None, None]
        h = model.layers[0](
            layer_input,
            attention_mask=causal,
            position_ids=positions,
            position_embeddings=model.rotary_emb(layer_input, positions),
        )
        theirs = model.lm_head(model.norm(h))[0]
        hidden = torch.cat([ours.fuse(aux[None]), ours.slot_feature(slots)[None]], dim=1)
        mine = ours(ids, hidden, positions)[0][0]
    return logit_check(theirs, mine, slice(n - 1, None))


def load_speculators_drafter(folder: Path, embed, head):
    """speculators' saved P-EAGLE checkpoint through eaglekit's own P-EAGLE reader (its speculators form), the
    EAGLE 3.1 flags taken from the config's top level, where speculators writes them and its model read them (the
    reader takes transformer_layer_config's, as vLLM does: the flags speculators trained with would be lost there).
    The target's embedding and head where the save leaves them out."""
    import dataclasses

    import torch

    from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
    from eaglekit.drafters.peagle import checkpoint as peagle_checkpoint
    from eaglekit.drafters.peagle.model import PEagleDrafter

    raw = json.loads((folder / "config.json").read_text())

    def read(path: Path):
        form, cfg, verifier = peagle_checkpoint.read_config(path)
        flags = {name: bool(raw.get(name, getattr(cfg, name))) for name in ("fc_norm", "norm_output")}
        return form, dataclasses.replace(cfg, **flags), verifier

    drafter, info = eagle3_checkpoint.load_drafter(folder, torch.float32, read=read, build=PEagleDrafter)
    with torch.no_grad():
        if info.missing_embeddings:
            drafter.embed_tokens.weight.copy_(embed)
        if torch.isnan(drafter.lm_head.weight).any() or drafter.lm_head.weight.abs().sum() == 0:
            drafter.lm_head.weight.copy_(head)
    return drafter


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = arguments(__doc__, "peagle_vs_speculators")
    p.add_argument("--depths", type=int, default=7, help="parallel depths trained (speculators' default 8)")
    p.add_argument(
        "--eaglekit-weights",
        choices=["decay", "cod"],
        default="decay",
        help="eaglekit's depth weights: train.ttt's 0.8^d (the default), or speculators' COD sampling's share of "
        "depth d, max(0.7^d, 0.2) (an ablation)",
    )
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if max(args.ks) > args.depths:
        sys.exit(f"--ks {max(args.ks)}: only {args.depths} depths are trained")

    import torch

    race = Race(args)

    def eaglekit_side(batches: list[dict], seed: int) -> dict:
        torch.manual_seed(seed)
        drafter = eaglekit_drafter(race.target, race.aux, race.mask_token_id)
        seconds, loss = train_eaglekit(drafter, race.target, batches, args)
        return {"train_s": round(seconds, 1), "tail_loss": round(loss, 4), "k": race.measured(drafter)}

    def speculators_side(job: dict) -> dict:
        job |= {"depths": args.depths}
        seconds = run_child(__file__, job, args)
        summary = json.loads((Path(job["out"]) / "summary.json").read_text())
        check = checked(summary)
        drafter = load_speculators_drafter(Path(job["out"]) / "final", race.embed, race.head)
        return {"train_s": round(seconds, 1), "tail_loss": round(summary["tail_loss"], 4)} | {
            "forward_check": check,
            "k": race.measured(drafter),
        }

    race.run(f"P-EAGLE (1 layer, {args.depths} depths, fc_norm)", eaglekit_side, speculators_side)


if __name__ == "__main__":
    main()

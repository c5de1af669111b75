"""One change to eaglekit's side of a race against speculators 0.9.0, everything else the race's own: what was tried
to put eaglekit's block drafters ahead of the peer's rather than level (benchmarks/results/races.md, "What was tried").

The family's race script (``<family>_vs_speculators.py``) runs as it is, with its options after ``--``; this script
only changes how eaglekit's drafter starts, what its loss reads or which optimizer steps it. speculators' side is the
race's saved seeds (linked from the race's own --out into ``ablation-<name>/`` beside them), so an ablation costs
eaglekit's side only: run the race itself first for the seeds you ask for.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/race_ablations.py dspark soft-target -- --seeds 3

  soft-target     the block loss against the target's whole next-token distribution (cross-entropy with its
                  softmax: the KL up to a constant) instead of its argmax (dflash, dspark)
  target-layers   the draft layers and the final norm start as copies of the target's last layers (dflash, dspark,
                  dflash2; the tiny target's layer shape is the drafter's)
  zero-residual   each draft layer's o_proj and down_proj start at zero, so each layer starts as the identity
  final-norm      the final norm (before the frozen head, the target's) starts at the target's final norm; also for
                  peagle
  dpace-alpha=A   D-PACE's smoothing α (the race's, speculators' default: 0.5)
  init-std=S      every trainable matrix of the drafter but DSpark's Markov head (its own 0.01, speculators')
                  starts at normal(0, S) (the race's and speculators' 0.02)
  ema=D           the drafter measured is the exponential average of its weights over the steps (decay D)
  muon            torch.optim.Muon on the 2-D weights, AdamW on the rest (eaglekit's train.optimizer muon, weight
                  decay 0.1; speculators' CLI default optimizer)
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import race_common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eaglekit.drafters.dflash import objective  # noqa: E402

BLOCK = ("dflash", "dspark", "dflash2")
ABLATIONS = {
    "soft-target": ("dflash", "dspark"),
    "target-layers": BLOCK,
    "zero-residual": BLOCK,
    "final-norm": (*BLOCK, "peagle"),
    "dpace-alpha": BLOCK,
    "muon": BLOCK,
    "init-std": BLOCK,
    "ema": BLOCK,
}
VALUED = ("dpace-alpha", "init-std", "ema")


class Ablation:
    def __init__(self, name: str, value: float | None):
        self.name, self.value = name, value
        self.target = None  # the race's tiny target, kept when the race loads it

    # ---- how the drafter starts
    def start(self, drafter) -> None:
        target = self.target.model
        with torch.no_grad():
            if self.name in ("final-norm", "target-layers"):
                drafter.norm.weight.copy_(target.norm.weight)
            if self.name == "init-std":
                for name, weight in drafter.named_parameters():
                    if weight.requires_grad and weight.dim() == 2 and "markov" not in name:
                        weight.normal_(0.0, self.value)
            if self.name == "zero-residual":
                for layer in drafter.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
            if self.name == "target-layers":
                last = target.layers[len(target.layers) - len(drafter.layers) :]
                for mine, theirs in zip(drafter.layers, last, strict=True):
                    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        getattr(mine.self_attn, part).weight.copy_(getattr(theirs.self_attn, part).weight)
                    for part in ("gate_proj", "up_proj", "down_proj"):
                        getattr(mine.mlp, part).weight.copy_(getattr(theirs.mlp, part).weight)
                    mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
                    mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)

    # ---- the optimizer
    def optimizer(self, params: list, args):
        if self.name != "muon":
            return race_common.optimizer(params, args)
        from eaglekit.config import TrainConfig
        from eaglekit.training.optim import build_optimizer

        tc = TrainConfig(optimizer="muon", lr=args.lr)
        return build_optimizer(tc, [(f"p{i}", p) for i, p in enumerate(params)]), tc.grad_clip

    # ---- the block loss: race_common.train_block_eaglekit with the changes above
    def train_block(self, drafter, batches: list[dict], args, seed: int, extra_weight: float = 1.0) -> tuple:
        self.start(drafter)
        params = [p for p in drafter.parameters() if p.requires_grad]
        optim, clip = self.optimizer(params, args)
        generator = torch.Generator().manual_seed(seed)
        alpha = self.value if self.name == "dpace-alpha" else 0.5
        losses = []
        average = [p.detach().clone() for p in params] if self.name == "ema" else None
        t0 = time.perf_counter()
        for b in batches:
            inputs = (drafter, b["aux"], b["argmax"], b["input_ids"], b["loss_mask"], b["attention_mask"])
            options = dict(max_anchors=args.anchors, dpace_alpha=alpha, extra_weight=extra_weight)
            if self.name == "soft-target":
                out = self.soft_block_loss(inputs, b, generator, options)
            else:
                out = objective.block_loss(*inputs, generator=generator, **options)
            optim.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            optim.step()
            if average is not None:
                with torch.no_grad():
                    torch._foreach_lerp_(average, [p.detach() for p in params], 1.0 - self.value)
            losses.append(float(out.loss.detach()))
        if average is not None:
            with torch.no_grad():
                for p, a in zip(params, average, strict=True):
                    p.copy_(a)
        return time.perf_counter() - t0, race_common.tail_mean(losses)

    def soft_block_loss(self, inputs: tuple, batch: dict, generator: torch.Generator, options: dict):
        """block_loss with its per-slot cross-entropy taken against the target's softmax at each slot's label
        position. The anchors are drawn here from a copy of the generator's state, as block_loss then draws them,
        to find those positions; block_loss's own cross-entropy call is swapped for the soft one meanwhile."""
        drafter, _, _, input_ids, loss_mask, attention_mask = inputs
        with torch.no_grad():
            logits = self.target.lm_head(self.target.model.norm(batch["pre_norm"])).float()
        state = generator.get_state()
        anchors, _ = objective.select_anchors(loss_mask * attention_mask, options["max_anchors"], generator)
        generator.set_state(state)
        first, length = drafter.first_drafting_slot, input_ids.shape[1]
        index = (anchors[:, :, None] + torch.arange(drafter.config.block_size) + (1 - first)).clamp_max(length - 1)
        rows = torch.arange(input_ids.shape[0])[:, None, None]
        soft = torch.softmax(logits[rows, (index - 1).clamp_min(0)], -1).flatten(0, 2)
        hard = F.cross_entropy

        def cross_entropy(slot_logits, labels, reduction="mean", **kw):
            if slot_logits.shape[0] != soft.shape[0]:
                return hard(slot_logits, labels, reduction=reduction, **kw)
            return -(soft * torch.log_softmax(slot_logits, -1)).sum(-1)

        F.cross_entropy = cross_entropy  # objective.F is torch.nn.functional itself: put back below
        try:
            return objective.block_loss(*inputs, generator=generator, **options)
        finally:
            F.cross_entropy = hard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("family", choices=sorted({f for fams in ABLATIONS.values() for f in fams}))
    p.add_argument("ablation", help=f"one of {sorted(ABLATIONS)} (dpace-alpha=A)")
    p.add_argument("race_args", nargs=argparse.REMAINDER, help="after --: the race script's own options")
    args = p.parse_args()
    name, _, value = args.ablation.partition("=")
    if name not in ABLATIONS or args.family not in ABLATIONS[name] or (name in VALUED) != bool(value):
        sys.exit(
            f"{args.ablation} does not apply to {args.family} (ablations: {ABLATIONS}; {', '.join(VALUED)} take =value)"
        )
    ablation = Ablation(name, float(value) if value else None)
    race_args = [a for a in args.race_args if a != "--"]

    keep = race_common.Race.__init__

    def race_init(race, race_options):
        keep(race, race_options)
        ablation.target = race.target

    race_common.Race.__init__ = race_init
    race_common.train_block_eaglekit = ablation.train_block
    if name == "final-norm" and args.family == "peagle":
        from eaglekit.drafters.eagle3.model import Eagle3Drafter

        build = Eagle3Drafter.__init__

        def peagle_init(drafter, *a, **kw):  # every drafter eaglekit's side builds; speculators' loads over it
            build(drafter, *a, **kw)
            if ablation.target is not None:
                with torch.no_grad():
                    drafter.norm.weight.copy_(ablation.target.model.norm.weight)

        Eagle3Drafter.__init__ = peagle_init

    race_out = ROOT / "runs" / f"{args.family}_vs_speculators"
    if "--out" in race_args:
        race_out = Path(race_args[race_args.index("--out") + 1])
        race_args = [a for i, a in enumerate(race_args) if a != "--out" and race_args[i - 1 : i] != ["--out"]]
    out = race_out / f"ablation-{args.ablation}"
    out.mkdir(parents=True, exist_ok=True)
    for saved in race_out.glob("speculators-seed*"):  # speculators' side: the race's saved seeds
        link = out / saved.name
        if not link.exists():
            link.symlink_to(saved.resolve())
    script = ROOT / "benchmarks" / f"{args.family}_vs_speculators.py"
    sys.argv = [str(script), "--out", str(out), *race_args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()

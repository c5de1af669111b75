"""The τ race's "why": per-TTT-step accuracy of the race's drafters on held-out samples, and whether speculators'
TTT and eaglekit's compute the same thing.

Reads the run directory of benchmarks/tau_vs_speculators.py (--out). Two figures, both teacher-forced (the
ground-truth tokens go in at every step, as in training) on the first --samples samples of the held-out split:

  per step     for each --drafter NAME=PATH (eaglekit or speculators checkpoint): eaglekit's ttt_loss per step,
               the share of counted positions where the draft's argmax is the target's, and the soft
               cross-entropy against the target's distribution.
  same TTT     for --same-ttt PATH (a speculators checkpoint): speculators' own Eagle3DraftModel.forward (its
               draft tokens per step) against eaglekit's ttt_loss on the same drafter and samples, counting a
               prediction where its input token is in the loss mask (speculators' convention) and where the
               predicted token is (eaglekit's). Equal accuracies at every step mean the two TTTs feed, attend,
               align and target alike, and only what training does with them differs.

    benchmarks/.venv-speculators/bin/python benchmarks/tau_race_probe.py --out /tmp/tau-race \\
        --drafter eaglekit=/tmp/tau-race/run/train/checkpoints/step-300 \\
        --drafter speculators=/tmp/tau-race/speculators-lr0.003/final --same-ttt /tmp/tau-race/speculators-lr0.003/final

--same-ttt needs speculators (benchmarks/.venv-speculators); the per-step part runs in any python with eaglekit.
Every figure is isolated: a drafter or a side that fails is printed with its error and the others still are.
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_step import describe_failure  # noqa: E402


def isolated(label: str, fn, *args) -> None:
    """Run one figure; if it fails, say so with its error and go on to the next."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 — one drafter or side failing must not lose the others' figures
        print(f"{label}: failed ({describe_failure(e)})", flush=True)


def main() -> None:
    from eaglekit.config import TargetConfig, TTTConfig, load_config
    from eaglekit.data.tokens import TokenStore
    from eaglekit.drafters.eagle3.checkpoint import load_drafter
    from eaglekit.drafters.eagle3.ttt import ttt_loss
    from eaglekit.model.target import TargetFeatures, aux_layer_ids, decoder_parts, load_target, target_hf_config
    from eaglekit.training.data import split_indices

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/eaglekit-tau-race"), help="the race's --out")
    p.add_argument("--drafter", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--same-ttt", type=Path, help="a speculators checkpoint")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--steps", type=int, default=4, help="TTT steps (the race trains 4)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(args.out / "config.yaml")
    store = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors")
    held = split_indices(store, cfg.data.eval_fraction)[1][: args.samples]
    tc = TargetConfig(model=cfg.target.model)
    target = load_target(tc, "cpu")
    aux = aux_layer_ids(tc, target_hf_config(tc).num_hidden_layers)
    samples = [(store[i][1].long()[None], store[i][2].long()[None]) for i in held]
    print(f"{len(samples)} held-out samples, {sum(m.sum().item() for _, m in samples)} loss-masked tokens")

    def features(drafter, ids, last_hidden: bool = False):
        feats = TargetFeatures(target, aux, drafter.t2d.cpu())
        if not last_hidden:
            return feats(ids, torch.ones_like(ids)), None
        pre = {}
        handle = decoder_parts(target)[2].register_forward_pre_hook(lambda m, a: pre.__setitem__("h", a[0]))
        try:
            return feats(ids, torch.ones_like(ids)), pre["h"]
        finally:
            handle.remove()

    def per_step(drafter, mask_of=lambda mask: mask) -> tuple[list[float], list[float]]:
        hits, ce, n = torch.zeros(args.steps), torch.zeros(args.steps), torch.zeros(args.steps)
        for ids, mask in samples:
            f, _ = features(drafter, ids)
            out = ttt_loss(
                drafter,
                f.aux.float(),
                ids,
                f.target_logits.float(),
                mask_of(mask),
                torch.ones_like(ids),
                settings=TTTConfig(steps=args.steps),
                target_in_draft=f.target_in_draft,
            )
            c = torch.tensor(out.count_k, dtype=torch.float)
            hits += torch.tensor(out.acc_k) * c
            ce += torch.tensor(out.loss_k) * c
            n += c
        return (hits / n).tolist(), (ce / n).tolist()

    fmt = lambda xs: "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"  # noqa: E731
    with torch.no_grad():

        def drafter_figures(name: str, path: str) -> None:
            drafter, _ = load_drafter(path)
            acc, ce = per_step(drafter.eval())
            print(f"per step  {name:<12} acc_k {fmt(acc)}  soft CE_k {fmt(ce)}", flush=True)

        for name, path in (d.split("=", 1) for d in args.drafter):
            isolated(f"per step  {name}", drafter_figures, name, path)
        if args.same_ttt:
            same_ttt(args, samples, features, per_step, fmt)


def same_ttt(args, samples, features, per_step, fmt) -> None:
    from eaglekit.drafters.eagle3.checkpoint import load_drafter

    ours, _ = load_drafter(args.same_ttt)
    isolated("same TTT  speculators forward", speculators_forward, args, samples, features, ours, fmt)

    def eaglekit_figure(label: str, mask_of) -> None:
        acc, _ = per_step(ours, mask_of)
        print(f"same TTT  {label} acc_k {fmt(acc)}", flush=True)

    isolated(
        "same TTT  eaglekit ttt_loss, speculators' mask",
        eaglekit_figure,
        "eaglekit ttt_loss, speculators' mask",
        lambda mask: F.pad(mask[:, :-1], (1, 0)),
    )
    isolated(
        "same TTT  eaglekit ttt_loss, eaglekit's mask",
        eaglekit_figure,
        "eaglekit ttt_loss, eaglekit's mask  ",
        lambda mask: mask,
    )


def speculators_forward(args, samples, features, ours, fmt) -> None:
    """speculators' own Eagle3DraftModel.forward (eager: this probe runs on CPU) on the same drafter and samples."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(args.same_ttt)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a GPU
    spec = Eagle3DraftModel.from_pretrained(args.same_ttt, config=config).eval()
    hits, n = torch.zeros(args.steps), torch.zeros(args.steps)
    for ids, mask in samples:
        f, last = features(ours, ids, last_hidden=True)
        length = ids.shape[1]
        # speculators' shift_batch: token i+1 with the target's features at i; targets from the state at i+1
        drafts, _, _ = spec(
            hidden_states=f.aux[:, :-1].float(),
            input_ids=ids[:, 1:],
            document_ids=torch.zeros(1, length - 1, dtype=torch.long),
            loss_mask=mask[:, 1:].bool(),
            position_ids=torch.arange(1, length)[None],
            verifier_last_hidden_states=last[:, 1:].float(),
            ttt_steps=args.steps,
            ttt_step_loss_decay=0.8,
            loss_config=resolve_loss_config("kl_div", "eager"),
        )
        want = f.target_logits[0, 1:].argmax(-1)
        counted = mask[0, 1:].bool()
        for k in range(args.steps):  # chain i's step k predicts the token that the target's state at i+1+k predicts
            hits[k] += ((drafts[k][0, : length - 1 - k] == want[k:]) & counted[k:]).sum()
            n[k] += counted[k:].sum()
    print(f"same TTT  speculators forward, its mask       acc_k {fmt((hits / n).tolist())}", flush=True)


if __name__ == "__main__":
    main()

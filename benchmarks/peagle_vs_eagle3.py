"""P-EAGLE against EAGLE-3 on the tiny target: same layer, same data, same budget, same seeds.

data      the tiny target's task corpus (train split), rendered with its chat template, loss on the assistant turn;
          features online from the tiny target (aux layers [2, 4, 5]).
budget    --steps AdamW steps of --batch rows, lr --lr (constant), grad clip 0.5, per seed; the same batches in the
          same order for both drafters; the target's head frozen in (full vocabulary).
eagle3    eaglekit's EAGLE-3 (drafters/eagle3/ttt.py): one Llama layer with EAGLE 3.1's fc_norm + norm_output
          (eaglekit's default), TTT --ttt steps, weights 0.8^k.
peagle    eaglekit's P-EAGLE (drafters/peagle/): the same layer with fc_norm, mask_hidden and a slot token (the
          tokenizer's pad), trained by training-time test whose step d is parallel slot d (--ttt slots, 0.8^d).
measure   eaglekit's draft → verify loop (speculative/decode.py) on --prompts held-out prompts at temperature 0:
          τ (tokens per target pass) per K and acceptance per draft position.
cost      drafter layer-passes per verify round: EAGLE-3 runs its layer K times (one query each, each waiting on the
          last draft); P-EAGLE runs it once over the new verified positions and K-1 slots.

  .venv/bin/python benchmarks/peagle_vs_eagle3.py                        # 3 seeds
  .venv/bin/python benchmarks/peagle_vs_eagle3.py --seeds 0 --steps 150  # one seed
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eaglekit.config import TTTConfig  # noqa: E402
from eaglekit.drafters.dflash.model import default_mask_token_id  # noqa: E402
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eaglekit.drafters.eagle3.proposer import EagleProposer  # noqa: E402
from eaglekit.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter  # noqa: E402
from eaglekit.drafters.peagle.proposer import ParallelProposer  # noqa: E402
from eaglekit.model.draft_vocab import build_d2t_t2d  # noqa: E402
from eaglekit.model.target import TargetFeatures, default_aux_layers, draft_logits  # noqa: E402
from eaglekit.speculative.decode import generate  # noqa: E402
from eaglekit.tiny import ensure_tiny_target, sample_tasks  # noqa: E402
from eaglekit.tiny.build import batch_tensors, encode  # noqa: E402


def build(kind: str, model, tok, aux: list[int], seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    if kind == "peagle":
        config = PEagleConfig.from_target_config(
            model.config, vocab, aux, fc_norm=True, mask_token_id=default_mask_token_id(tok, vocab)
        )
        drafter: Eagle3Drafter = PEagleDrafter(config)
    else:
        drafter = Eagle3Drafter(
            DrafterConfig.from_target_config(model.config, vocab, aux, fc_norm=True, norm_output=True)
        )
    d2t, t2d = build_d2t_t2d(torch.arange(vocab), vocab)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(model.lm_head.weight)
    drafter.lm_head.weight.requires_grad_(False)  # the target's head, frozen (train.freeze_lm_head's default)
    return drafter


def train(drafter, features: TargetFeatures, rows, head: torch.Tensor, args, seed: int) -> float:
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    every = torch.ones(head.shape[0], dtype=torch.bool)
    t0 = time.perf_counter()
    for step in range(args.steps):
        picked = [rows[order[(step * args.batch + i) % len(rows)]] for i in range(args.batch)]
        ids, labels, attention = batch_tensors(picked, 0)
        f = features(ids, attention, with_logits=False)
        logits, _ = draft_logits(f.last_hidden, head, every)
        settings = TTTConfig(steps=args.ttt)
        loss = ttt_loss(drafter, f.aux, ids, logits, (labels != -100).long(), attention, settings=settings).loss
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optim.step()
    return time.perf_counter() - t0


def measure(kind: str, drafter, model, prompts, k: int, stop: set[int]) -> tuple[float, list[float]]:
    total = None
    for prompt in prompts:
        proposer = ParallelProposer(drafter) if kind == "peagle" else EagleProposer(drafter)
        stats = generate(model, prompt, 96, proposer=proposer, k=k, stop_ids=stop).stats
        total = stats if total is None else total + stats
    assert total is not None
    return total.tau, total.acceptance_by_position()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt", type=int, default=7, help="TTT steps (EAGLE-3) = parallel slots trained (P-EAGLE)")
    parser.add_argument("--drafters", nargs="+", default=["eagle3", "peagle"])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peagle_vs_eagle3.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_target()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    aux = default_aux_layers(model.config.num_hidden_layers)
    features = TargetFeatures(model, aux)
    rows = encode(tok, sample_tasks(1024, 0), random.Random(0))
    prompts = [ids[:start] for ids, start in encode(tok, sample_tasks(args.prompts, 1, "heldout"), random.Random(1))]
    stop = {tok.eos_token_id}
    head = model.lm_head.weight.detach()

    results: dict[str, dict] = {"args": vars(args) | {"out": str(args.out)}, "runs": []}
    for seed in args.seeds:
        for kind in args.drafters:
            drafter = build(kind, model, tok, aux, seed)
            seconds = train(drafter, features, rows, head, args, seed)
            drafter.eval()
            for k in args.ks:
                tau, positions = measure(kind, drafter, model, prompts, k, stop)
                row = {"seed": seed, "drafter": kind, "k": k, "tau": round(tau, 4), "train_s": round(seconds, 1)}
                row["acceptance_by_position"] = [round(p, 3) for p in positions]
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    print("\n| drafter | K | τ T=0 (mean ± sd over seeds) | layer-passes per round |")
    print("|---|---|---|---|")
    for kind in args.drafters:
        for k in args.ks:
            taus = [r["tau"] for r in results["runs"] if r["drafter"] == kind and r["k"] == k]
            sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
            cost = "1 (K queries)" if kind == "peagle" else f"{k} (one query each)"
            print(f"| {kind} | {k} | {statistics.mean(taus):.3f} ± {sd:.3f} | {cost} |")


if __name__ == "__main__":
    main()

"""Block drafters against the chain drafter: eaglekit's DFlash, DSpark and EAGLE-3, same data, same budget.

data      the tiny target's task corpus (train split), rendered with its chat template, loss on the assistant
          turn; features online from the tiny target (aux layers [2, 4, 5], the same taps for both drafters).
budget    --steps AdamW steps of --batch rows, lr --lr (constant), per seed; the same batches in the same order.
dflash    eaglekit's DFlash (training/block.py): --layers layers, block --block, CE with D-PACE, full vocabulary.
dspark    eaglekit's DSpark (model/dspark.py): DFlash's backbone with anchor sampling (block --block - 1, so it
          drafts as many tokens per round as DFlash) and the Markov head (rank --markov-rank), exp-decay weights.
eagle3    eaglekit's EAGLE-3 (training/ttt.py): one Llama layer with EAGLE 3.1's fc_norm + norm_output (eaglekit's
          default; --eagle3-form plain without), TTT --ttt steps, decay 0.8, full vocabulary.
measure   eaglekit's draft → verify loop (speculative/decode.py) on --prompts held-out prompts at temperature 0:
          τ (tokens per target pass) per K and acceptance per draft position.
cost      drafter layer-passes per verify round: EAGLE-3 runs its layer K times (one query each); DFlash runs
          its layers once over K+1 queries, DSpark once over K (the context's keys/values are projected once per
          verified token); DSpark's Markov head adds K small lookups.

  .venv/bin/python benchmarks/dflash_vs_eagle3.py                        # 3 seeds, ~4 min on 2 CPU cores
  .venv/bin/python benchmarks/dflash_vs_eagle3.py --seeds 0 --steps 60   # a quick look
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
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_mask_token_id  # noqa: E402
from eaglekit.drafters.dflash.objective import block_loss  # noqa: E402
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter  # noqa: E402
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eaglekit.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eaglekit.drafters.registry import proposer_for  # noqa: E402
from eaglekit.model.draft_vocab import build_d2t_t2d  # noqa: E402
from eaglekit.model.target import TargetFeatures, default_aux_layers, draft_logits, target_argmax  # noqa: E402
from eaglekit.speculative.decode import generate  # noqa: E402
from eaglekit.tiny import ensure_tiny_target, sample_tasks  # noqa: E402
from eaglekit.tiny.build import batch_tensors, encode  # noqa: E402


def build(kind: str, model, tok, aux: list[int], args, seed: int):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    if kind in ("dflash", "dspark"):
        mask = default_mask_token_id(tok, vocab)
        shape = dict(num_hidden_layers=args.layers, shared_k_norm=True)
        if kind == "dspark":
            config = DSparkConfig.from_target_config(
                model.config, aux, mask, block_size=args.block - 1, markov_rank=args.markov_rank, **shape
            )
            drafter: DFlashDrafter = DSparkDrafter(config)
        else:
            drafter = DFlashDrafter(
                DFlashConfig.from_target_config(model.config, aux, mask, block_size=args.block, **shape)
            )
        drafter.take_target(embed, head)
        return drafter
    flags = (
        args.eagle3_form == "3.1"
    )  # EAGLE 3.1's fc_norm + norm_output: eaglekit's default (the τ race's lever table)
    eagle = Eagle3Drafter(
        DrafterConfig.from_target_config(
            model.config, draft_vocab_size=vocab, aux_layer_ids=aux, fc_norm=flags, norm_output=flags
        )
    )
    d2t, t2d = build_d2t_t2d(torch.arange(vocab), vocab)
    eagle.d2t.copy_(d2t)
    eagle.t2d.copy_(t2d)
    with torch.no_grad():
        eagle.embed_tokens.weight.copy_(embed)
        eagle.lm_head.weight.copy_(head)
    eagle.lm_head.weight.requires_grad_(False)  # the target's head, frozen (train.freeze_lm_head's default)
    return eagle


def train(kind: str, drafter, features: TargetFeatures, rows, head: torch.Tensor, args, seed: int) -> float:
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    t0 = time.perf_counter()
    for step in range(args.steps):
        picked = [rows[order[(step * args.batch + i) % len(rows)]] for i in range(args.batch)]
        ids, labels, attention = batch_tensors(picked, 0)
        loss_mask = (labels != -100).long()
        f = features(ids, attention, with_logits=False)
        if kind in ("dflash", "dspark"):
            argmax = target_argmax(f.last_hidden, head)
            loss = block_loss(drafter, f.aux, argmax, ids, loss_mask, attention, generator=generator).loss
        else:
            logits, _ = draft_logits(f.last_hidden, head, torch.ones(head.shape[0], dtype=torch.bool))
            loss = ttt_loss(drafter, f.aux, ids, logits, loss_mask, attention, settings=TTTConfig(steps=args.ttt)).loss
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optim.step()
    return time.perf_counter() - t0


def measure(kind: str, drafter, model, prompts, k: int, stop: set[int]) -> tuple[float, list[float]]:
    total = None
    for prompt in prompts:
        stats = generate(model, prompt, 96, proposer=proposer_for(drafter), k=k, stop_ids=stop).stats
        total = stats if total is None else total + stats
    assert total is not None
    return total.tau, total.acceptance_by_position()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument(
        "--eagle3-form",
        choices=["3.1", "plain"],
        default="3.1",
        help="EAGLE-3 with EAGLE 3.1's fc_norm + norm_output (eaglekit's default) or the plain form",
    )
    parser.add_argument("--markov-rank", type=int, default=32, help="DSpark's Markov head rank (speculators: 256)")
    parser.add_argument("--drafters", nargs="+", default=["dflash", "dspark", "eagle3"])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "dflash_vs_eagle3.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

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
            drafter = build(kind, model, tok, aux, args, seed)
            seconds = train(kind, drafter, features, rows, head, args, seed)
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
            queries = {"dflash": k + 1, "dspark": k}.get(kind)
            cost = f"{args.layers} (one pass, {queries} queries)" if queries else f"{k} (one query each)"
            print(f"| {kind} | {k} | {statistics.mean(taus):.3f} ± {sd:.3f} | {cost} |")


if __name__ == "__main__":
    main()

"""DFlash2 against DFlash on the tiny target: the same data, seeds, batches and steps (benchmarks/dflash_vs_eagle3.py's
training and measurement), and DFlash2 served without its selector (what an engine that ignores it drafts).

dflash     eaglekit's DFlash (drafters/dflash/): --layers layers, block --block, CE with D-PACE, full vocabulary.
dflash2    eaglekit's DFlash2 (drafters/dflash2/): the same backbone with the grouped dynamic convolutions (2 taps,
           groups of 16) and the path selector (rank --selector-rank, top --top-k), its cross-entropy added at
           weight 1; drafted with the selector's greedy walk, as vLLM's V2 runner drafts at T=0.
fallback   the same DFlash2 drafter drafting each slot's argmax (vLLM's V1 runner before 0.32: plain DFlash).
measure    eaglekit's draft -> verify loop (speculative/decode.py) on --prompts held-out prompts at T=0: τ per K.
           Offline decoding here is a chain (one path per round), which is also what vLLM's walk proposes.

  .venv/bin/python benchmarks/dflash2_vs_dflash.py                 # 3 seeds
  .venv/bin/python benchmarks/dflash2_vs_dflash.py --seeds 0       # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dflash_vs_eagle3 import train  # noqa: E402

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_mask_token_id  # noqa: E402
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter  # noqa: E402
from eaglekit.drafters.dflash2.proposer import DFlash2Proposer  # noqa: E402
from eaglekit.drafters.registry import proposer_for  # noqa: E402
from eaglekit.model.target import TargetFeatures, default_aux_layers  # noqa: E402
from eaglekit.speculative.decode import generate  # noqa: E402
from eaglekit.tiny import ensure_tiny_target, sample_tasks  # noqa: E402
from eaglekit.tiny.build import encode  # noqa: E402


def build(kind: str, model, tok, aux: list[int], args, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    mask = default_mask_token_id(tok, model.config.vocab_size)
    shape = dict(num_hidden_layers=args.layers, block_size=args.block, shared_k_norm=True)
    if kind == "dflash2":
        config = DFlash2Config.from_target_config(
            model.config, aux, mask, selector_rank=args.selector_rank, selector_top_k=args.top_k, **shape
        )
        drafter: DFlashDrafter = DFlash2Drafter(config)
    else:
        drafter = DFlashDrafter(DFlashConfig.from_target_config(model.config, aux, mask, **shape))
    drafter.take_target(model.get_input_embeddings().weight, model.lm_head.weight)
    return drafter


def tau(model, prompts, proposer_of, k: int, stop: set[int]) -> float:
    total = None
    for prompt in prompts:
        stats = generate(model, prompt, 96, proposer=proposer_of(), k=k, stop_ids=stop).stats
        total = stats if total is None else total + stats
    assert total is not None
    return total.tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--selector-rank", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "dflash2_vs_dflash.json")
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

    runs = []
    for seed in args.seeds:
        for kind in ("dflash", "dflash2"):
            drafter = build(kind, model, tok, aux, args, seed)
            seconds = train("dflash", drafter, features, rows, head, args, seed)  # the block objective for both
            drafter.eval()
            ways = {kind: lambda d=drafter: proposer_for(d)}
            if kind == "dflash2":
                ways["dflash2 without selector"] = lambda d=drafter: DFlash2Proposer(d, selector=False)
            for name, proposer_of in ways.items():
                for k in args.ks:
                    row = {
                        "seed": seed,
                        "drafter": name,
                        "k": k,
                        "tau": round(tau(model, prompts, proposer_of, k, stop), 4),
                    }
                    runs.append(row | {"train_s": round(seconds, 1)})
                    print(json.dumps(runs[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=2) + "\n")

    print("\n| drafter | K | τ T=0 (mean ± sd over seeds) |")
    print("|---|---|---|")
    for name in ("dflash", "dflash2", "dflash2 without selector"):
        for k in args.ks:
            taus = [r["tau"] for r in runs if r["drafter"] == name and r["k"] == k]
            sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
            print(f"| {name} | {k} | {statistics.mean(taus):.3f} ± {sd:.3f} |")


if __name__ == "__main__":
    main()

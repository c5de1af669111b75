"""The family table: every drafter family eaglekit trains, on the tiny target, with the same data, seeds and budget.

data      the tiny target's task corpus (train split), rendered with its chat template, loss on the assistant
          turn; features online from the tiny target at the same taps for every family (aux layers [2, 4, 5]).
budget    --steps AdamW steps (betas --betas, weight decay and grad clip: the train stage's defaults) of --batch rows
          at lr --lr (constant), per seed; the same batches in the same order for every family (the order is the
          seed's, not the family's).
eagle3    EAGLE-3 (drafters/eagle3/): one Llama layer with EAGLE 3.1's fc_norm + norm_output (eaglekit's default;
          --eagle3-form plain without), training-time test of --ttt steps, weights 0.8^k, full vocabulary, the
          target's head frozen.
peagle    P-EAGLE (drafters/peagle/): the same layer with fc_norm (norm_output off, its family's default: no draft
          feeds another), mask_hidden and a slot token; training-time test whose step d is parallel slot d.
dflash    DFlash (drafters/dflash/): --layers Qwen3 layers, block --block (anchor + mask slots), CE on the target's
          argmax with D-PACE (α 0.5), 512 anchors per row, full vocabulary, one shared k_norm (vLLM's CPU build).
dspark    DSpark (drafters/dspark/): DFlash's backbone drafting from the anchor (block --block - 1, so it drafts as
          many tokens a round as DFlash), the Markov head at rank --markov-rank; the same loss and weights.
dflash2   DFlash2 (drafters/dflash2/): DFlash's backbone with the grouped dynamic convolutions (--conv-kernel taps,
          groups of --conv-group channels) and the path selector (rank --selector-rank, top --selector-top-k) whose
          cross-entropy is added at weight 1; drafted with the selector's greedy walk (vLLM's V2 runner at T=0);
          --dflash2-fallback also measures it drafting each slot's argmax (what an engine without the selector does).
measure   eaglekit's draft -> verify loop (speculative/decode.py) on --prompts held-out prompts, --new-tokens new
          tokens at T=0: τ (tokens per target pass) per K and acceptance per draft position.
cost      drafter layer-passes per verify round (--layers for the block families: one pass of K or K+1 queries; 1
          for P-EAGLE: one pass of its verified positions and K-1 slots; K for EAGLE-3: its layer once per draft).

Each (family, seed) is trained and measured on its own, so runs may be split over processes: every row is appended
to --out (JSON lines, with the settings that made it) as soon as it is measured, and a row already there is not
run again. --table prints the table of the rows in --out (mean and 95 % bootstrap interval over the seeds).

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/family_table.py                             # 5 families x 3 seeds
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/family_table.py --families dflash dspark dflash2 --layers 5 \\
      --block 16 --markov-rank 256 --selector-rank 256 --label peer-shape                  # the peers' shape
  .venv/bin/python benchmarks/family_table.py --table                                      # the table of --out
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tau_vs_speculators import bootstrap  # noqa: E402  (mean and 95 % percentile-bootstrap interval over seeds)

from eaglekit.config import TrainConfig, TTTConfig  # noqa: E402
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_mask_token_id  # noqa: E402
from eaglekit.drafters.dflash.objective import block_loss  # noqa: E402
from eaglekit.drafters.dflash2.model import DFlash2Config, DFlash2Drafter  # noqa: E402
from eaglekit.drafters.dflash2.proposer import DFlash2Proposer  # noqa: E402
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter  # noqa: E402
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eaglekit.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter  # noqa: E402
from eaglekit.drafters.registry import proposer_for  # noqa: E402
from eaglekit.model.draft_vocab import build_d2t_t2d  # noqa: E402
from eaglekit.model.target import TargetFeatures, default_aux_layers, draft_logits, target_argmax  # noqa: E402
from eaglekit.speculative.decode import generate  # noqa: E402
from eaglekit.tiny import ensure_tiny_target, sample_tasks  # noqa: E402
from eaglekit.tiny.build import batch_tensors, encode  # noqa: E402

FAMILIES = ("eagle3", "peagle", "dflash", "dspark", "dflash2")
TRAIN_DEFAULTS = TrainConfig()  # the optimizer settings every family trains with here
BLOCK_FAMILIES = ("dflash", "dspark", "dflash2")
FALLBACK = "dflash2 without selector"  # DFlash2's drafter measured as plain DFlash drafts (--dflash2-fallback)
# the settings that make a row: a row of --out is reused only where all of these match the run asked for
SETTINGS = ("target", "steps", "batch", "lr", "betas", "ttt", "eagle3_form", "chain_layers", "layers", "block", "dspark_block",
            "markov_rank", "conv_kernel", "conv_group", "selector_rank", "selector_top_k", "selector_weight", "window",
            "prompts", "long_rows", "per_group", "groups", "new_tokens")  # fmt: skip


def build(family: str, model, tok, aux: list[int], args, seed: int) -> torch.nn.Module:
    """The family's drafter on the target's shapes, its embedding and head the target's (the head frozen)."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    mask = default_mask_token_id(tok, vocab)
    if family in BLOCK_FAMILIES:
        shape: dict[str, Any] = dict(num_hidden_layers=args.layers, shared_k_norm=True, sliding_window=args.window)
        block: DFlashDrafter
        if family == "dspark":
            config = DSparkConfig.from_target_config(
                model.config,
                aux,
                mask,
                block_size=args.dspark_block or args.block - 1,
                markov_rank=args.markov_rank,
                **shape,
            )
            block = DSparkDrafter(config)
        elif family == "dflash2":
            config = DFlash2Config.from_target_config(
                model.config,
                aux,
                mask,
                block_size=args.block,
                conv_kernel_size=args.conv_kernel,
                conv_group_size=args.conv_group,
                selector_rank=args.selector_rank,
                selector_top_k=args.selector_top_k,
                **shape,
            )
            block = DFlash2Drafter(config)
        else:
            block = DFlashDrafter(
                DFlashConfig.from_target_config(model.config, aux, mask, block_size=args.block, **shape)
            )
        block.take_target(embed, head)
        return block
    chain: Eagle3Drafter
    if family == "peagle":
        config = PEagleConfig.from_target_config(
            model.config,
            vocab,
            aux,
            fc_norm=True,
            mask_token_id=mask,
            sliding_window=args.window,
            num_layers=args.chain_layers,
        )
        chain = PEagleDrafter(config)
    else:
        flags = args.eagle3_form == "3.1"  # EAGLE 3.1's fc_norm + norm_output: eaglekit's default
        chain = Eagle3Drafter(
            DrafterConfig.from_target_config(
                model.config,
                draft_vocab_size=vocab,
                aux_layer_ids=aux,
                fc_norm=flags,
                norm_output=flags,
                sliding_window=args.window,
                num_layers=args.chain_layers,
            )
        )
    d2t, t2d = build_d2t_t2d(torch.arange(vocab), vocab)
    chain.d2t.copy_(d2t)
    chain.t2d.copy_(t2d)
    with torch.no_grad():
        chain.embed_tokens.weight.copy_(embed)
        chain.lm_head.weight.copy_(head)
    chain.lm_head.weight.requires_grad_(False)  # the target's head, frozen (train.freeze_lm_head's default)
    return chain


def train(family: str, drafter, features: TargetFeatures, rows, head: torch.Tensor, args, seed: int) -> float:
    """--steps steps of the family's objective on the seed's batches; the seconds it took."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.betas), weight_decay=TRAIN_DEFAULTS.weight_decay)
    generator = torch.Generator().manual_seed(seed)  # the block objective's anchors
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    every = torch.ones(head.shape[0], dtype=torch.bool)
    t0 = time.perf_counter()
    for step in range(args.steps):
        picked = [rows[order[(step * args.batch + i) % len(rows)]] for i in range(args.batch)]
        ids, labels, attention = batch_tensors(picked, 0)
        loss_mask = (labels != -100).long()
        f = features(ids, attention, with_logits=False)
        if family in BLOCK_FAMILIES:
            argmax = target_argmax(f.last_hidden, head)
            loss = block_loss(
                drafter,
                f.aux,
                argmax,
                ids,
                loss_mask,
                attention,
                generator=generator,
                extra_weight=args.selector_weight,
            ).loss
        else:
            logits, _ = draft_logits(f.last_hidden, head, every)
            loss = ttt_loss(drafter, f.aux, ids, logits, loss_mask, attention, settings=TTTConfig(steps=args.ttt)).loss
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, TRAIN_DEFAULTS.grad_clip)
        optim.step()
    return time.perf_counter() - t0


def measure(proposer_of, model, prompts, k: int, stop: set[int], new_tokens: int) -> tuple[float, list[float]]:
    """τ and acceptance by draft position over the prompts, a fresh proposer per prompt."""
    total = None
    for prompt in prompts:
        stats = generate(model, prompt, new_tokens, proposer=proposer_of(), k=k, stop_ids=stop).stats
        total = stats if total is None else total + stats
    assert total is not None
    return total.tau, total.acceptance_by_position()


def measure_by_context(proposer_of, model, groups: dict[str, list], k: int, stop: set[int], new_tokens: int) -> dict:
    """measure() per context group: {group: τ}."""
    return {
        group: round(measure(proposer_of, model, prompts, k, stop, new_tokens)[0], 4)
        for group, prompts in groups.items()
    }


def tiny_target(args) -> tuple[Any, Any, list, dict[str, list]]:
    """The tiny target, its task corpus (train split) and --prompts held-out prompts (one group)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_target()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = encode(tok, sample_tasks(1024, 0), random.Random(0))
    prompts = [ids[:start] for ids, start in encode(tok, sample_tasks(args.prompts, 1, "heldout"), random.Random(1))]
    return model, tok, rows, {"all": prompts}


def long_target(args) -> tuple[Any, Any, list, dict[str, list]]:
    """The long-context tiny target (v6, docs/long-context.md), --long-rows of its tasks' conversations (train split)
    at evaluate's shortest context group (< 1K: trained short), and --per-group held-out prompts of every group
    (seed 900, benchmarks/long_context.py's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglekit.tiny import ensure_long_target
    from eaglekit.tiny.long_build import PROMPT_TOKENS, heldout_long_tasks, prompt_ids, render
    from eaglekit.tiny.long_corpus import filler_lines, sample_long_tasks

    path = ensure_long_target()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    lines = filler_lines(PROMPT_TOKENS["<1k"])
    rows = []
    for i, task in enumerate(sample_long_tasks(args.long_rows, 1, (lines * 9 // 10, lines), split="train")):
        full = tok(render(tok, task, system=bool(i % 2)), add_special_tokens=False)["input_ids"]
        rows.append((full, len(prompt_ids(tok, task, system=bool(i % 2)))))
    groups = {group: [prompt_ids(tok, task) for task in heldout_long_tasks(args.per_group, group, 900)]
              for group in args.groups or PROMPT_TOKENS}  # fmt: skip
    return model, tok, rows, groups


def measure_drafter(kind: str, drafter, model, prompts, k: int, stop: set[int]) -> tuple[float, list[float]]:
    """measure() with the drafter's own proposer and 96 new tokens (benchmarks/dflash_vs_speculators.py's)."""
    return measure(lambda: proposer_for(drafter), model, prompts, k, stop, 96)


def layer_passes(family: str, k: int, layers: int, chain_layers: int = 1) -> str:
    """The drafter's layer-passes per verify round, and what each pass carries."""
    if family == "eagle3":
        return f"{k * chain_layers} ({k} passes of one query)"
    if family == "peagle":
        return f"{chain_layers} (one pass, {k - 1} slots)"
    queries = k if family == "dspark" else k + 1
    extra = {"dspark": " + Markov", "dflash2": " + selector"}.get(family, "")
    return f"{layers} (one pass, {queries} queries){extra}"


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def same_settings(row: dict, settings: dict) -> bool:
    """Whether a row of --out was made with these settings (a setting the row predates is taken at its default)."""
    defaults = vars(parser().parse_args([]))
    return all(row["settings"].get(name, defaults[name]) == value for name, value in settings.items())


def print_table(rows: list[dict], label: str | None) -> None:
    """The rows' table per setting, drafter and K: τ per seed, mean and 95 % bootstrap interval; for the long target
    τ per context group (mean of seeds) and the share of < 1K's τ kept at > 16K."""
    if label is not None:
        rows = [r for r in rows if r.get("label") == label]
    keys = sorted({(r.get("label", ""), r["drafter"], r["k"]) for r in rows}, key=lambda x: (x[0], _order(x[1]), x[2]))
    long = [
        key
        for key in keys
        if any("tau_by_context" in r for r in rows if (r.get("label", ""), r["drafter"], r["k"]) == key)
    ]
    short = [key for key in keys if key not in long]
    if short:
        print(
            "\n| setting | drafter | K | τ T=0 per seed | mean [95 % bootstrap] | × EAGLE-3 [95 %] | acceptance by position "
            "| layer-passes |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for key in short:
        group = sorted((r for r in rows if (r.get("label", ""), r["drafter"], r["k"]) == key), key=lambda r: r["seed"])
        taus = [r["tau"] for r in group]
        _, low, high = bootstrap(taus)
        positions = [statistics.fmean(p) for p in zip(*(r["acceptance_by_position"] for r in group), strict=False)]
        # against EAGLE-3 of the same setting and K (its seeds resampled on their own)
        chain = [r["tau"] for r in rows if (r.get("label", ""), r["drafter"], r["k"]) == (key[0], "eagle3", key[2])]
        ratio = "×{:.3f} [{:.3f}, {:.3f}]".format(*bootstrap(taus, chain)) if chain and key[1] != "eagle3" else "—"
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {', '.join(f'{t:.3f}' for t in taus)} | "
            f"{statistics.fmean(taus):.3f} [{low:.3f}, {high:.3f}] | {ratio} | "
            f"{' '.join(f'{p:.3f}' for p in positions)} | {group[0]['layer_passes']} |"
        )
    if long:
        contexts = list(next(r["tau_by_context"] for r in rows if "tau_by_context" in r))
        print(
            f"\n| setting | drafter | K | seeds | {' | '.join(contexts)} | kept at > 16K per seed | kept: mean [95 % bootstrap] |"
        )
        print("|---|---|---|---|" + "---|" * len(contexts) + "---|---|")
    for key in long:
        group = sorted((r for r in rows if (r.get("label", ""), r["drafter"], r["k"]) == key), key=lambda r: r["seed"])
        by = {c: statistics.fmean(r["tau_by_context"][c] for r in group) for c in contexts}
        kept = [r["tau_by_context"][">16k"] / r["tau_by_context"]["<1k"] for r in group]
        _, low, high = bootstrap(kept)
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(group)} | {' | '.join(f'{by[c]:.3f}' for c in contexts)} | "
            f"{', '.join(f'{x:.1%}' for x in kept)} | {statistics.fmean(kept):.1%} [{low:.1%}, {high:.1%}] |"
        )


def _order(drafter: str) -> int:
    return FAMILIES.index(drafter) if drafter in FAMILIES else len(FAMILIES)


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def parser(**defaults: Any) -> argparse.ArgumentParser:
    """The table's options; an older benchmark's command line passes its own defaults (e.g. its drafters)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--families", "--drafters", dest="families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--betas", type=float, nargs=2, default=list(TRAIN_DEFAULTS.adam_betas), help="AdamW's (train.adam_betas')"
    )
    p.add_argument("--ttt", type=int, default=7, help="TTT steps (EAGLE-3) = parallel slots trained (P-EAGLE)")
    p.add_argument("--eagle3-form", choices=["3.1", "plain"], default="3.1",
                   help="EAGLE-3 with EAGLE 3.1's fc_norm + norm_output (eaglekit's default) or the plain form")  # fmt: skip
    p.add_argument("--chain-layers", type=int, default=1, help="EAGLE-3's and P-EAGLE's layers (eaglekit's default: 1)")
    p.add_argument("--layers", type=int, default=2, help="the block families' layers (eaglekit's default: 5)")
    p.add_argument(
        "--block", type=int, default=8, help="DFlash's and DFlash2's block; DSpark's is one less (default 16)"
    )
    p.add_argument("--dspark-block", type=int, help="DSpark's block (its drafts per block; default: --block - 1)")
    p.add_argument("--markov-rank", type=int, default=32, help="DSpark's Markov head rank (eaglekit's default: 256)")
    p.add_argument("--conv-kernel", type=int, default=2, help="DFlash2's convolution taps")
    p.add_argument("--conv-group", type=int, default=16, help="DFlash2's channels per dynamic coefficient")
    p.add_argument("--selector-rank", type=int, default=64, help="DFlash2's selector rank (eaglekit's default: 256)")
    p.add_argument("--selector-top-k", "--top-k", dest="selector_top_k", type=int, default=16)
    p.add_argument(
        "--selector-weight", type=float, default=1.0, help="DFlash2's selector loss weight (0: the backbone's)"
    )
    p.add_argument("--dflash2-fallback", action="store_true", help="also measure DFlash2 without its selector")
    p.add_argument("--window", type=int, help="every family's sliding window (default: none, full attention)")
    p.add_argument("--target", choices=["tiny", "long"], default="tiny",
                   help="the tiny target, or the long-context one (trained short, τ per context group)")  # fmt: skip
    p.add_argument("--long-rows", type=int, default=160, help="--target long: training conversations (< 1K)")
    p.add_argument("--per-group", type=int, default=3, help="--target long: held-out prompts per context group")
    p.add_argument("--groups", nargs="+", choices=["<1k", "1-4k", "4-16k", ">16k"],
                   help="--target long: the context groups measured (default: all four)")  # fmt: skip
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument(
        "--label", help="names the setting in --out (default: the target's name) and, with --table, the rows printed"
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "family_table.jsonl")
    p.add_argument("--table", action="store_true", help="print the table of --out's rows (of --label if given)")
    p.set_defaults(**defaults)
    return p


def main(argv: list[str] | None = None, **defaults: Any) -> None:
    args = parser(**defaults).parse_args(argv)
    if args.table:
        print_table(load_rows(args.out), args.label)
        return
    args.label = args.label or args.target

    model, tok, rows, groups = (long_target if args.target == "long" else tiny_target)(args)
    aux = default_aux_layers(model.config.num_hidden_layers)
    features = TargetFeatures(model, aux)
    stop = {tok.eos_token_id}
    head = model.lm_head.weight.detach()

    settings = {name: getattr(args, name) for name in SETTINGS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["drafter"], r["seed"], r["k"]) for r in load_rows(args.out)
            if r.get("label") == args.label and same_settings(r, settings)}  # fmt: skip
    for seed in args.seeds:
        for family in args.families:
            ways = {family: lambda d: proposer_for(d)}  # each family as its engine drafts it
            if family == "dflash2" and args.dflash2_fallback:
                ways[FALLBACK] = lambda d: DFlash2Proposer(d, selector=False)
            if all((name, seed, k) in done for name in ways for k in args.ks):
                continue
            drafter = build(family, model, tok, aux, args, seed)
            seconds = train(family, drafter, features, rows, head, args, seed)
            drafter.eval()
            for name, way in ways.items():
                for k in args.ks:
                    proposer_of = functools.partial(way, drafter)
                    if args.target == "long":
                        by_context = measure_by_context(proposer_of, model, groups, k, stop, args.new_tokens)
                        tau, positions = by_context["<1k"], []
                    else:
                        tau, positions = measure(proposer_of, model, groups["all"], k, stop, args.new_tokens)
                    passes = layer_passes(family if name != FALLBACK else "dflash", k, args.layers, args.chain_layers)
                    row = {"label": args.label, "drafter": name, "seed": seed, "k": k, "tau": round(tau, 4),
                           "acceptance_by_position": [round(p, 3) for p in positions], "layer_passes": passes,
                           "train_s": round(seconds, 1), "commit": commit(), "settings": settings}  # fmt: skip
                    if args.target == "long":
                        row["tau_by_context"] = by_context
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(json.dumps({k: v for k, v in row.items() if k != "settings"}), flush=True)
    print_table([r for r in load_rows(args.out) if r.get("label") == args.label and same_settings(r, settings)], None)


if __name__ == "__main__":
    main()

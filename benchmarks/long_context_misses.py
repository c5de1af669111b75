"""Where a drafter loses at long context: its drafts on the long-context tiny target by the reply token's role and
by draft position, per context group (docs/long-context.md).

Reads a run of `benchmarks/long_context.py` (its config and trained drafter), decodes --per-group of its evaluation
prompts of each context group with the target greedily and the run's drafter proposing K tokens a pass, exactly as
evaluate does, and counts for every draft position the drafts accepted and the first one rejected, by the role in
the target's reply of the token that position had to guess (`tiny.long_corpus.reply_token_role`: a decision that
only the far notes settle, a code name that follows from the line before, a separator, other). Prints one table per
K; asserts nothing.

    python benchmarks/long_context_misses.py /tmp/long/window-none-seed-0.yaml --k 3,5
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from eaglekit.config import load_config
from eaglekit.drafters.checked import decoding_inputs
from eaglekit.drafters.registry import proposer_for
from eaglekit.model.target import load_target
from eaglekit.speculative.decode import CONTEXT_BUCKETS, context_bucket, generate
from eaglekit.tiny.long_corpus import REPLY_ROLES, reply_token_role


def tally(generation, tokenizer, k: int, max_new_tokens: int, counts: Counter) -> None:
    """Add one generation's passes to ``counts``[(group, role, position, accepted?)]: those that drafted all K
    (near the end a pass drafts fewer, so that it stays within ``max_new_tokens``)."""
    at = 1  # the prefill's token comes before the first pass
    for accepted, context in zip(generation.accepted_per_round, generation.context_per_round, strict=True):
        if at > max_new_tokens - k - 1:
            break
        group = context_bucket(context)
        for position in range(min(accepted + 1, k)):
            if at + position >= len(generation.tokens):
                break
            role = reply_token_role(tokenizer.decode([generation.tokens[at + position]]))
            counts[(group, role, position, position < accepted)] += 1
        at += accepted + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="a long_context.py run's config (RUN.yaml beside its folder)")
    p.add_argument("--k", default="3,5")
    p.add_argument("--per-group", type=int, default=2, help="prompts decoded per context group")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    target = load_target(cfg.target, torch.device("cpu"))
    inputs = decoding_inputs(cfg, target, torch.device("cpu"), cfg.evaluate.max_new_tokens)
    chosen: Counter = Counter()
    prompts = []
    for _, ids in inputs.prompts:
        group = context_bucket(len(ids))
        if chosen[group] < args.per_group:
            chosen[group] += 1
            prompts.append(ids)
    groups = [label for label, _ in CONTEXT_BUCKETS if chosen[label]]
    for k in (int(x) for x in args.k.split(",")):
        counts: Counter = Counter()
        for ids in prompts:
            generation = generate(target, ids, cfg.evaluate.max_new_tokens, k=k, stop_ids=inputs.stop_ids,
                                  proposer=proposer_for(inputs.drafter, inputs.aux))  # fmt: skip
            tally(generation, inputs.tokenizer, k, cfg.evaluate.max_new_tokens, counts)
        print(f"\n{args.config.stem}, K={k}: drafts accepted / drafted for (the first rejected counted as drafted)")
        print("| role | position | " + " | ".join(groups) + " |")
        print("|---|---|" + "---|" * len(groups))
        for role in REPLY_ROLES:
            for position in range(k):
                cells = []
                for group in groups:
                    right, wrong = counts[(group, role, position, True)], counts[(group, role, position, False)]
                    cells.append(f"{right}/{right + wrong}" if right + wrong else "–")
                if any(c != "–" for c in cells):
                    print(f"| {role} | {position} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

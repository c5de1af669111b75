"""How far the long-context tiny target's features at long context drift from those a drafter trains on: the
tapped hidden states (the drafter's input) over the same reply, after the whole long log and after a short twin of
it (benchmarks/results/long-context.md, "Why the window alone loses at > 16K").

For --per-group held-out prompts of each context group, the twin keeps the log's needles and its first few filler
lines, so the question, the reply and every decision are the same and only the context's length differs. The
target reads both conversations, reply included, and the script prints, per group and per tapped layer, the RMS of
the difference of the two states over the reply's tokens as a share of the twin's RMS; and the same by the role of
the token the state is taken at (a state predicts the token after it: at a desk, the decision). A windowed drafter
reads nothing past its window, but its input features are these, and one trained on short rows saw only the twin's.
Asserts nothing.

    python benchmarks/long_context_drift.py --per-group 3
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.model.target import TargetFeatures, default_aux_layers
from eaglekit.tiny.long_build import PROMPT_TOKENS, ensure_long_target, heldout_long_tasks, prompt_ids, render
from eaglekit.tiny.long_corpus import REPLY_ROLES, LongTask, reply_token_role

TWIN_FILLER = 8  # filler lines the short twin keeps: a log of a few hundred tokens, as the drafter's rows


def short_twin(task: LongTask) -> LongTask:
    keep = sorted(set(task.needle_lines) | set(range(TWIN_FILLER)))
    return replace(
        task,
        lines=tuple(task.lines[i] for i in keep),
        needle_lines=tuple(keep.index(i) for i in task.needle_lines),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-group", type=int, default=3, help="held-out prompts per context group")
    p.add_argument("--seed", type=int, default=900)
    args = p.parse_args()
    folder = ensure_long_target()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = default_aux_layers(model.config.num_hidden_layers)
    features = TargetFeatures(model, layers)
    width = model.config.hidden_size
    print(f"target {folder}; tapped layers {layers}; drift = RMS(long - short) / RMS(short) over the reply's tokens")
    print("| group | tokens | " + " | ".join(f"layer {i}" for i in layers) + " | " + " | ".join(REPLY_ROLES) + " |")
    print("|---|---|" + "---|" * (len(layers) + len(REPLY_ROLES)))
    for group in PROMPT_TOKENS:
        if group == "<1k":
            continue  # the twin of a short log is itself
        squares: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        lengths = []
        for task in heldout_long_tasks(args.per_group, group, args.seed):
            long_ids, short_ids = (
                tokenizer(render(tokenizer, t, system=False), add_special_tokens=False)["input_ids"]
                for t in (task, short_twin(task))
            )
            n = len(long_ids) - len(prompt_ids(tokenizer, task))  # the reply's tokens, its header's included
            assert long_ids[-n:] == short_ids[-n:], "the twin's reply tokenises apart from the log's"
            lengths.append(len(long_ids))
            states = [features(torch.tensor([ids]), with_logits=False).aux[0, -n:] for ids in (long_ids, short_ids)]
            far, near = (s.unflatten(-1, (len(layers), width)) for s in states)
            roles = [reply_token_role(tokenizer.decode([t])) for t in long_ids[-n:]]
            for j, layer in enumerate(layers):
                squares[f"layer {layer}"][0] += (far[:, j] - near[:, j]).pow(2).sum().item()
                squares[f"layer {layer}"][1] += near[:, j].pow(2).sum().item()
            for i, role in enumerate(roles):
                squares[role][0] += (far[i] - near[i]).pow(2).sum().item()
                squares[role][1] += near[i].pow(2).sum().item()
        cells = [
            f"{(squares[key][0] / squares[key][1]) ** 0.5:.3f}" if squares[key][1] else "–"
            for key in [f"layer {i}" for i in layers] + list(REPLY_ROLES)
        ]
        print(f"| {group} | ~{sum(lengths) // len(lengths):,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

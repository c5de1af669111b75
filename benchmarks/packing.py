"""Training benchmark: what packing buys on length-skewed data — real tokens per second over one epoch.

The same samples (lengths drawn from a long-tailed log-normal, as chat data is) go through eaglekit's TTT step
(target head, ttt_loss, backward, AdamW) batched four ways:
  padded, shuffled     batch_size rows in random order, right-padded to the longest (no length bucketing)
  padded, bucketed     eaglekit's default: length-bucketed batches (training/data.py epoch_batches)
  packed 1 x T         one row of up to T tokens per step (training/data.py packed_batches), as speculators packs
  packed R x T         R rows of up to T tokens per step
Reported per way: steps, the share of computed positions that are real tokens, real tokens per second and the
ratio to the bucketed default. Each way runs --rounds times, the order reversed every other round (A B C D D C B A)
so that the machine's load drifts over all of them alike; medians. Prints figures, asserts nothing.

    python benchmarks/packing.py                      # H=256, 64 samples, ~10 min on one CPU thread
    python benchmarks/packing.py --device cuda --hidden 4096 --samples 512 --pack-length 8192
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ttt_step import DECAY, Shape, adamw, draft_logits, make_batch, make_drafter, sync  # noqa: E402

from eaglekit.config import TTTConfig  # noqa: E402
from eaglekit.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eaglekit.training.data import epoch_batches, packed_batches  # noqa: E402


def skewed_lengths(n: int, median: int, sigma: float, longest: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return [int(x) for x in draws.clamp(16, longest).round()]


def layouts(
    lengths: list[int], batch: int, pack_length: int, pack_rows: int, seed: int
) -> dict[str, list[list[list[int]]]]:
    """Each way's steps, every step a list of rows, every row a list of sample indices."""
    import random

    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    shuffled = [[[i] for i in order[j : j + batch]] for j in range(0, len(order), batch)]
    bucketed = [[[i] for i in b] for b in epoch_batches(list(range(len(lengths))), lengths, batch, seed, 0)]
    return {
        "padded, shuffled": shuffled,
        "padded, bucketed": bucketed,
        f"packed 1 x {pack_length}": packed_batches(order, lengths, 1, pack_length, seed, 0),
        f"packed {pack_rows} x {pack_length}": packed_batches(order, lengths, pack_rows, pack_length, seed, 0),
    }


def step_tensors(rows: list[list[int]], data: dict, lengths: list[int]) -> dict[str, torch.Tensor]:
    """One micro-batch: rows of samples end to end, right-padded; position ids restart per sample."""
    offsets = data["offsets"]
    width = max(sum(lengths[i] for i in row) for row in rows)
    out = {
        k: torch.zeros(len(rows), width, *data[k].shape[1:], dtype=data[k].dtype)
        for k in ("aux", "input_ids", "last_hidden")
    }
    out["attention_mask"] = torch.zeros(len(rows), width, dtype=torch.long)
    out["position_ids"] = torch.arange(width).repeat(len(rows), 1)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            for k in ("aux", "input_ids", "last_hidden"):
                out[k][r, at : at + n] = data[k][offsets[i] : offsets[i] + n]
            out["attention_mask"][r, at : at + n] = 1
            out["position_ids"][r, at : at + n] = torch.arange(n)
            at += n
        out["position_ids"][r, at:] = torch.arange(width - at) + (lengths[row[-1]] if row else 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--median", type=int, default=250, help="median sample length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of the lengths")
    p.add_argument("--longest", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="rows per padded micro-batch")
    p.add_argument("--pack-length", type=int, default=2048)
    p.add_argument("--pack-rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=7, help="TTT steps K")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gqa", type=int, default=2, help="query heads per KV head")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA unless given")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)

    lengths = skewed_lengths(args.samples, args.median, args.sigma, args.longest, args.seed)
    total = sum(lengths)
    shape = dict(vocab=args.vocab, draft_vocab=args.draft_vocab, head_dim=args.head_dim, gqa=args.gqa)
    s = Shape(args.hidden, max(lengths), steps=args.steps, **shape)
    flat = make_batch(Shape(args.hidden, total, **shape), args.seed)
    data = {
        "aux": flat["aux"][0],
        "input_ids": flat["input_ids"][0],
        "last_hidden": flat["last_hidden"][0],
        "offsets": [sum(lengths[:i]) for i in range(len(lengths))],
    }
    drafter = make_drafter(s, flat).to(device, dtype)
    optim = adamw(drafter.parameters())
    head, t2d = flat["head"].to(device, dtype), flat["t2d"].to(device)
    ways = layouts(lengths, args.batch, args.pack_length, args.pack_rows, args.seed)
    batches = {
        name: [{k: v.to(device) for k, v in step_tensors(rows, data, lengths).items()} for rows in steps]
        for name, steps in ways.items()
    }
    print(
        f"torch {torch.__version__}, device {device}, dtype {str(dtype).removeprefix('torch.')}, threads "
        f"{torch.get_num_threads()}; H={args.hidden} V={args.vocab} Vd={args.draft_vocab} K={args.steps}\n"
        f"{len(lengths)} samples, {total} tokens: lengths median {statistics.median(lengths):.0f}, mean "
        f"{total / len(lengths):.0f}, max {max(lengths)} (log-normal sigma {args.sigma})"
    )

    def epoch(name: str) -> float:
        sync(device)
        t0 = time.perf_counter()
        for b in batches[name]:
            packed = name.startswith("packed")
            with torch.no_grad():
                logits, in_draft = draft_logits(b["last_hidden"].to(dtype), head, t2d)
            out = ttt_loss(
                drafter,
                b["aux"].to(dtype),
                b["input_ids"],
                logits,
                b["attention_mask"],
                b["attention_mask"],
                settings=TTTConfig(steps=args.steps, decay=DECAY),
                target_in_draft=in_draft,
                position_ids=b["position_ids"] if packed else None,
            )
            out.loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    epoch(list(batches)[-1])  # warm: allocator, kernels
    times: dict[str, list[float]] = {name: [] for name in batches}
    for r in range(args.rounds):
        for name in list(batches) if r % 2 == 0 else list(reversed(batches)):
            times[name].append(epoch(name))
            print(f"  round {r + 1}: {name:22s} {times[name][-1]:7.1f} s", flush=True)

    base = statistics.median(times["padded, bucketed"])
    rows = []
    print("\n| batching | steps | real / computed positions | tokens/s | vs bucketed |\n|---|---:|---:|---:|---:|")
    for name, steps in ways.items():
        computed = sum(len(rows) * max(sum(lengths[i] for i in row) for row in rows) for rows in steps)
        median = statistics.median(times[name])
        rows.append(
            {
                "batching": name,
                "steps": len(steps),
                "fill": total / computed,
                "seconds": times[name],
                "tokens_per_s": total / median,
                "vs_bucketed": base / median,
            }
        )
        print(f"| {name} | {len(steps)} | {total / computed:.0%} | {total / median:.0f} | x{base / median:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "lengths": lengths, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

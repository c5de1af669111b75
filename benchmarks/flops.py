"""Training benchmark: the FLOP rate eaglekit's TTT step achieves, as a share of this machine's dense matmul rate.

The step's FLOPs are counted analytically (a multiply-add is 2 FLOPs), per TTT step k over the rows it computes
(every position at step 0; at steps >= 1 the chains with a counted position left, taken from ttt_loss's count_k,
which is exact for a loss mask without holes, as here):
  fc            2 * 3Ht * H per position, step 0 only
  qkv, o        2 * 2H * (nH + 2 nKV) * hd  and  2 * nH * hd * H per row
  attention     4 * nH * hd per (query, key) pair: causal at step 0 (L(L+1)/2 pairs a row), and at step k the
                t+1 step-0 keys plus k diagonal keys of chain t
  MLP           6 * H * I per row
  lm_head       2 * H * Vd per counted row
  target head   2 * Ht * V per position (draft_logits, no gradient)
Backward costs twice the forward (x3 in all) for everything that trains, x2 for fc (its input needs no
gradient), x1 for the target head. These are model FLOPs: the attention scores that backward recomputes and
the elementwise work are not counted, so the share is a lower bound on how busy the machine is.

The matmul rate is a large fp32 (or the given dtype) square matmul, timed alternately with the steps in the same
run so both see the same load.

    python benchmarks/flops.py                       # CPU, H=256 L=512 and H=512 L=2048
    python benchmarks/flops.py --device cuda --sizes 4096x4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_step import Shape, eaglekit_side, make_batch, parse_sizes, sync  # noqa: E402


def step_flops(s: Shape, count_k: list[int], frozen_head: bool = False) -> dict[str, float]:
    """Training FLOPs of one TTT step by part (forward x backward multiplier applied; a frozen lm_head needs no
    weight gradient: x2)."""
    h, hd, nh, nkv = s.hidden, s.head_dim, s.heads, s.kv_heads
    positions, seqs, length = s.tokens, s.batch, s.seq
    rows = [positions] + count_k[1:]  # rows computed per step
    per_row_layer = 2 * 2 * h * (nh + 2 * nkv) * hd + 2 * nh * hd * h + 6 * h * s.intermediate
    pair = 4 * nh * hd
    causal_pairs = seqs * length * (length + 1) // 2
    chain_pairs = 0
    for k in range(1, s.steps):
        chains = count_k[k] // seqs  # per sequence: chains t = 0 .. chains-1
        chain_pairs += seqs * (chains * (chains + 1) // 2 + k * chains)
    return {
        "fc": 2 * (2 * positions * 3 * h * h),
        "layer (qkv, o, MLP)": 3 * per_row_layer * sum(rows),
        "attention, step 0 (causal)": 3 * pair * causal_pairs,
        "attention, steps >= 1": 3 * pair * chain_pairs,
        "lm_head": (2 if frozen_head else 3) * 2 * h * s.draft_vocab * sum(count_k),
        "target head (no grad)": 2 * positions * h * s.vocab,
    }


def matmul_seconds(n: int, device: str, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    a @ b
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="256x512,512x2048", help="comma-separated HIDDENxSEQLEN")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gqa", type=int, default=2, help="query heads per KV head")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA unless given")
    p.add_argument("--matmul-n", type=int, default=None, help="square matmul size (2048 on CPU, 8192 on CUDA)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    n = args.matmul_n or (2048 if device == "cpu" else 8192)
    print(
        f"torch {torch.__version__}, device {device}, dtype {str(dtype).removeprefix('torch.')}, "
        f"threads {torch.get_num_threads()}, matmul {n}x{n}"
    )
    results = []
    for hidden, seq in parse_sizes(args.sizes):
        s = Shape(
            hidden,
            seq,
            steps=args.steps,
            vocab=args.vocab,
            draft_vocab=args.draft_vocab,
            head_dim=args.head_dim,
            gqa=args.gqa,
        )
        step, _ = eaglekit_side(s, make_batch(s), device, dtype)
        for _ in range(args.warmup):
            count_k = step().count_k
        step_s, mm_s = [], []
        for _ in range(args.repeats):  # alternate so both see the same machine load
            mm_s.append(matmul_seconds(n, device, dtype))
            sync(device)
            t0 = time.perf_counter()
            count_k = step().count_k
            sync(device)
            step_s.append(time.perf_counter() - t0)
        mm_s.append(matmul_seconds(n, device, dtype))
        parts = step_flops(s, count_k)
        total = sum(parts.values())
        achieved = total / statistics.median(step_s)
        peak = 2 * n**3 / statistics.median(mm_s)
        print(f"\n{s.label()}  V={s.vocab} Vd={s.draft_vocab}: {total / 1e9:.1f} GFLOP per training step")
        for name, f in parts.items():
            print(f"  {name:28s} {f / 1e9:9.2f} GFLOP  {100 * f / total:5.1f} %")
        print(
            f"  step {statistics.median(step_s):.3f} s -> {achieved / 1e9:.1f} GFLOP/s; dense matmul "
            f"{peak / 1e9:.1f} GFLOP/s; achieved share {100 * achieved / peak:.0f} %"
        )
        results.append(
            dict(
                label=s.label(),
                shape=asdict(s),
                gflop=total / 1e9,
                parts_gflop={k: v / 1e9 for k, v in parts.items()},
                step_s=step_s,
                matmul_s=mm_s,
                achieved_gflops=achieved / 1e9,
                matmul_gflops=peak / 1e9,
                share=achieved / peak,
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv, torch=torch.__version__, results=results), indent=1))


if __name__ == "__main__":
    main()

"""Training benchmark: peak memory of one TTT step vs sequence length, and what each extra TTT step costs.

For each length L it measures the peak growth of one training step (ttt_step.step_peak_mib: forward, backward,
AdamW, after a warm step) at K=7 and K=1; (peak(K=7) - peak(K=1)) / 6 is the memory of one extra TTT step.
That increment should grow linearly in L — the TTT attention of steps >= 1 keeps no L x L matrix for
backward — so the fitted exponent of increment ~ L^b should be about 1 (2 would mean a square matrix per
step). speculators is measured too where it is importable and L <= --speculators-max-len (its eager attention on
CPU keeps an L x (k+1)L score matrix per step, which outgrows this machine quickly). Each measurement is isolated:
one that fails is printed and recorded with its error and the run goes on (speculators runs as it ships; its
fallbacks are ttt_step.py's --speculators-mode). Prints figures, asserts nothing.

    python benchmarks/ttt_memory.py                                    # eaglekit, H=256, L=512..8192
    benchmarks/.venv-speculators/bin/python benchmarks/ttt_memory.py   # and speculators up to L=2048
    python benchmarks/ttt_memory.py --baseline d3cd37f                 # and eaglekit's TTT at that commit
    python benchmarks/ttt_memory.py --device cuda --variants reference,fused   # the fused GPU kernels too
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_step import (  # noqa: E402
    WARM_LENGTH,
    Shape,
    cpu_peak_mib,
    describe_failure,
    make_side,
    speculators_missing,
    step_peak_mib,
)


def peak_mib(side: str, s: Shape, device: str, dtype: torch.dtype) -> float:
    if device == "cpu":
        return cpu_peak_mib(side, s, torch.get_num_threads())
    step, _ = make_side(side, s, device, dtype)
    try:
        step(WARM_LENGTH)
        return step_peak_mib(step, device)
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares b in log y = a + b log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=False)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lengths", default="512,1024,2048,4096,8192")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gqa", type=int, default=2, help="query heads per KV head")
    p.add_argument("--speculators-max-len", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA unless given")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", help="also measure eaglekit's TTT as it was at this git commit")
    p.add_argument("--variants", default="reference", help="eaglekit's kernels (ttt_step.py): reference,fused,compiled")
    p.add_argument("--eaglekit-only", action="store_true", help="leave speculators out even where it imports")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    lengths = [int(x) for x in args.lengths.split(",")]
    why_not = "--eaglekit-only" if args.eaglekit_only else speculators_missing()
    eaglekit = ["eaglekit" if v == "reference" else f"eaglekit+{v}" for v in args.variants.split(",")]
    sides = eaglekit + ([f"eaglekit@{args.baseline}"] if args.baseline else []) + ([] if why_not else ["speculators"])
    print(
        f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, H={args.hidden} "
        f"V={args.vocab} Vd={args.draft_vocab}; peak growth of one training step, MiB"
    )
    if why_not:
        print(f"speculators is not importable here ({why_not}): eaglekit alone")

    results = {}
    for side in sides:
        rows = []
        print(f"\n{side}\n  {'L':>6} {'K=1':>9} {'K=' + str(args.steps):>9} {'per step':>9} {'per step/1k tok':>16}")
        for length in lengths:
            if side == "speculators" and length > args.speculators_max_len:
                continue
            shapes = [
                Shape(
                    args.hidden,
                    length,
                    steps=k,
                    vocab=args.vocab,
                    draft_vocab=args.draft_vocab,
                    head_dim=args.head_dim,
                    gqa=args.gqa,
                )
                for k in (1, args.steps)
            ]
            try:
                one, full = (peak_mib(side, s, args.device, dtype) for s in shapes)
            except Exception as e:  # noqa: BLE001 — one side or length failing must not lose the other figures
                rows.append(dict(seq=length, failed=describe_failure(e)))
                print(f"  {length:6d} failed: {describe_failure(e)}", flush=True)
                continue
            per_step = (full - one) / (args.steps - 1)
            rows.append(dict(seq=length, k1_mib=one, k_mib=full, per_step_mib=per_step))
            print(f"  {length:6d} {one:9.1f} {full:9.1f} {per_step:9.1f} {per_step / length * 1000:16.2f}", flush=True)
        results[side] = rows
        usable = [r for r in rows if r.get("per_step_mib", 0) > 0]
        if len(usable) >= 2:
            b = loglog_slope([r["seq"] for r in usable], [r["per_step_mib"] for r in usable])
            growth = usable[-1]["per_step_mib"] / usable[0]["per_step_mib"]
            span = usable[-1]["seq"] / usable[0]["seq"]
            print(
                f"  per-step memory ~ L^{b:.2f} (1 = linear, 2 = an L x L matrix per step); "
                f"x{growth:.1f} for x{span:.0f} the length"
            )
            results[side + "_exponent"] = b
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv, torch=torch.__version__, results=results), indent=1))


if __name__ == "__main__":
    main()

"""Long context: τ by context length on the long-context tiny target, for EAGLE-3 drafters trained on short rows,
with and without a sliding window (docs/long-context.md).

Writes, under --out, training prompts of evaluate's "<1k" group (the replies' rows stay under ~650 tokens: trained
short) and evaluation prompts of every group (~450, ~2.6K, ~8.8K, ~19.9K tokens), then runs `eaglekit run --until
evaluate` once per drafter and seed (generate with the target in-process, prepare, vocab, train online, evaluate) and
prints τ per context group from each run's evaluate/report.json. Offline decoding only (no engine); asserts nothing.

    python benchmarks/long_context.py --out /tmp/long --windows none,256 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from eaglekit.tiny import ensure_long_target
from eaglekit.tiny.long_build import write_long_prompts

GROUPS = ("<1k", "1-4k", "4-16k", ">16k")


def write_prompts(out: Path, train: int, per_group: int) -> tuple[Path, Path]:
    train_file = write_long_prompts(out / "train.jsonl", train, 1, context="<1k")
    rows: list[str] = []
    for i, group in enumerate(GROUPS):
        part = write_long_prompts(out / f"eval-{i}.jsonl", per_group, 900, context=group)
        rows += Path(part).read_text().splitlines()
    (out / "eval.jsonl").write_text("\n".join(rows) + "\n")
    return Path(train_file), out / "eval.jsonl"


def config(target: Path, train_file: Path, eval_file: Path, run_dir: Path, window: int | None, seed: int, k: int,
           steps: int) -> dict:  # fmt: skip
    draft: dict = {"intermediate_size": 256}
    if window is not None:
        draft["sliding_window"] = window
    return {
        "run_dir": str(run_dir),
        "target": {"model": str(target)},
        "data": {"prompts": str(train_file), "eval_fraction": 0.05},
        "generate": {"backend": "local", "max_tokens": 200, "temperature": 0.0, "batch_size": 16},
        "prepare": {"max_length": 2048},
        "vocab": {"draft_vocab_size": 80},
        "train": {"max_steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 10, "eval_every": steps,
                  "save_every": steps, "ttt_steps": 4, "seed": seed, "draft": draft},
        "evaluate": {"prompts": str(eval_file), "num_samples": 10_000, "num_speculative_tokens": [k],
                     "temperatures": [0.0], "max_new_tokens": 96},
        "export": {"verifier": None},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", default="none,256", help="comma-separated: none (full attention) or a window")
    p.add_argument("--seeds", default="0")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--train-prompts", type=int, default=160)
    p.add_argument("--per-group", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = ensure_long_target()
    train_file, eval_file = write_prompts(args.out, args.train_prompts, args.per_group)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    for window_text in args.windows.split(","):
        window = None if window_text == "none" else int(window_text)
        for seed in (int(s) for s in args.seeds.split(",")):
            name = f"window-{window_text}-seed-{seed}"
            path = args.out / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config(target, train_file, eval_file, args.out / name, window, seed,
                                                  args.k, args.steps)))  # fmt: skip
            cli = [sys.executable, "-c", "import sys; from eaglekit.cli import main; sys.argv[0] = 'eaglekit'; main()"]
            subprocess.run([*cli, "run", str(path), "--until", "evaluate"], env=env, check=True)
            report = json.loads((args.out / name / "evaluate" / "report.json").read_text())
            row = next(r for r in report["results"] if r["method"] == "eagle")
            rows.append((window_text, seed, row))
            print(json.dumps({"window": window_text, "seed": seed, "tau": row["tau"],
                              "tau_by_context": row["tau_by_context"]}), flush=True)  # fmt: skip
    print(f"\n| window | seed | τ K={args.k} | " + " | ".join(GROUPS) + " | >16k / <1k |")
    print("|" + "---|" * (4 + len(GROUPS)))
    for window_text, seed, row in rows:
        by = row["tau_by_context"]
        cells = [f"{by[g]['tau']:.3f} ({by[g]['rounds']})" if g in by else "–" for g in GROUPS]
        kept = by[">16k"]["tau"] / by["<1k"]["tau"] if ">16k" in by and "<1k" in by else float("nan")
        print(f"| {window_text} | {seed} | {row['tau']:.3f} | " + " | ".join(cells) + f" | {kept:.2f} |")


if __name__ == "__main__":
    main()

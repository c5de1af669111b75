"""Long context: τ by context length on the long-context tiny target, for EAGLE-3 (or, with --family dflash, DFlash)
drafters trained on short rows, with and without a sliding window (docs/long-context.md); with --long-rows, on the
same short rows plus long ones.

Writes, under --out, training prompts of evaluate's "<1k" group (the replies' rows stay under ~650 tokens: trained
short; --long-rows M,N adds M prompts of the 4-16k group and N of the >16k group, held-out tasks of other seeds than
the evaluation's, with prepare.max_length at the target's context so none is cut) and evaluation prompts of every
group (~450, ~2.6K, ~8.8K, ~19.9K tokens), then runs `eaglekit run --until evaluate` once per drafter and seed
(generate with the target in-process, prepare, vocab, train online, evaluate) and prints τ per context group from
each run's evaluate/report.json. Offline decoding only (no engine; --served adds vLLM's); asserts nothing.

    python benchmarks/long_context.py --out /tmp/long --windows none,256 --seeds 0
    python benchmarks/long_context.py --out /tmp/long-dflash --family dflash --windows none,256 --seeds 0
    python benchmarks/long_context.py --out /tmp/long-rows --windows auto,256 --seeds 0,1,2 --k 3,5 --long-rows 16,8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from eaglekit.config import load_config
from eaglekit.pipeline import fingerprint
from eaglekit.tiny import ensure_long_target
from eaglekit.tiny.long_build import write_long_prompts

GROUPS = ("<1k", "1-4k", "4-16k", ">16k")
# --family: the drafter's train.draft besides its window, and the export forms it is served from (export.formats and
# verify.formats name EAGLE-3's; a block drafter has its one form). DFlash as benchmarks/dflash_vs_eagle3.py trains it
# (2 layers, block 8), with the one k_norm vLLM's CPU build serves exactly (for --served).
FAMILIES: dict[str, tuple[dict, dict]] = {
    "llama": ({"intermediate_size": 256}, {"formats": ["eagle3"]}),
    "dflash": ({"architecture": "dflash", "intermediate_size": 256, "num_layers": 2, "block_size": 8,
                "shared_k_norm": True}, {}),
}  # fmt: skip


# --long-rows: the seeds of the long training prompts' tasks (the evaluation's are 900, the short rows' 1)
LONG_TRAIN_SEEDS = {"4-16k": 901, ">16k": 902}


def write_prompts(out: Path, train: int, per_group: int, long_rows: dict[str, int]) -> tuple[Path, Path]:
    train_file = write_long_prompts(out / "train.jsonl", train, 1, context="<1k")
    if any(long_rows.values()):
        lines = Path(train_file).read_text().splitlines()
        for group, n in long_rows.items():
            if n:
                part = write_long_prompts(out / f"train-{LONG_TRAIN_SEEDS[group]}.jsonl", n, LONG_TRAIN_SEEDS[group],
                                          context=group)  # fmt: skip
                lines += Path(part).read_text().splitlines()
        train_file = out / "train-long.jsonl"
        train_file.write_text("\n".join(lines) + "\n")
    rows: list[str] = []
    for i, group in enumerate(GROUPS):
        part = write_long_prompts(out / f"eval-{i}.jsonl", per_group, 900, context=group)
        rows += Path(part).read_text().splitlines()
    (out / "eval.jsonl").write_text("\n".join(rows) + "\n")
    return Path(train_file), out / "eval.jsonl"


def config(target: Path, train_file: Path, eval_file: Path, run_dir: Path, window: int | str | None, seed: int,
           ks: list[int], steps: int, family: str = "llama", max_length: int = 2048) -> dict:  # fmt: skip
    shape, forms = FAMILIES[family]
    draft: dict = {**shape, "sliding_window": window}  # None written out: no window, whatever the default; "auto" it
    return {
        "run_dir": str(run_dir),
        "target": {"model": str(target)},
        "data": {"prompts": str(train_file), "eval_fraction": 0.05},
        "generate": {"backend": "local", "max_tokens": 200, "temperature": 0.0, "batch_size": 16},
        "prepare": {"max_length": max_length},
        "vocab": {"draft_vocab_size": 80},
        "train": {"max_steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 10, "eval_every": steps,
                  "save_every": steps, "ttt": {"steps": 4}, "seed": seed, "draft": draft},
        "evaluate": {"prompts": str(eval_file), "num_samples": 10_000, "num_speculative_tokens": ks,
                     "temperatures": [0.0], "max_new_tokens": 96},
        "export": {"verifier": None, **forms},
        # --served: vLLM's CPU build serves the exported drafter on the same prompts; verify places each served
        # pass by the context it drafted from (vLLM's per-request counts), beside eaglekit's offline decoding
        "verify": {"engine": "vllm", **forms, "num_speculative_tokens": ks, "tau_tolerance": 1.0,
                   "position_tolerance": 1.0, "greedy_tolerance": 1.0},
    }  # fmt: skip


def interval(values: list[float]) -> str:
    """Mean ± the 95 % half-width of Student's t over the seeds (n − 1 degrees of freedom)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return f"{mean:.3f}"
    t95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}.get(n, 2.262)
    return f"{mean:.3f} ± {t95 * statistics.stdev(values) / math.sqrt(n):.3f}"


def print_tables(rows: list[tuple[str, int, dict]], ks: list[int]) -> None:
    """Per run, then per drafter over its seeds (mean ± 95 % interval): τ per context group and >16k / <1k."""
    for k in ks:
        print(f"\n| window | seed | τ K={k} | " + " | ".join(GROUPS) + " | >16k / <1k |")
        print("|" + "---|" * (4 + len(GROUPS)))
        by_window: dict[str, list[dict]] = {}
        for window_text, seed, row in rows:
            if row["k"] != k:
                continue
            by = row["tau_by_context"]
            by_window.setdefault(window_text, []).append(row)
            cells = [f"{by[g]['tau']:.3f} ({by[g]['rounds']})" if g in by else "–" for g in GROUPS]
            print(f"| {window_text} | {seed} | {row['tau']:.3f} | " + " | ".join(cells) + f" | {kept(by):.2f} |")
        print(f"\n| window | seeds | τ K={k} | " + " | ".join(GROUPS) + " | >16k / <1k |")
        print("|" + "---|" * (4 + len(GROUPS)))
        for window_text, runs in by_window.items():
            cells = [
                interval([r["tau_by_context"][g]["tau"] for r in runs if g in r["tau_by_context"]]) for g in GROUPS
            ]
            ratio = interval([kept(r["tau_by_context"]) for r in runs])
            tau = interval([r["tau"] for r in runs])
            print(f"| {window_text} | {len(runs)} | {tau} | " + " | ".join(cells) + f" | {ratio} |")


def print_served(runs: list[tuple[str, int, dict]]) -> None:
    """Served (vLLM) beside offline τ per context group, each run and K, from verify's reports."""
    print("\n| window | seed | K | " + " | ".join(f"{g} served / offline" for g in GROUPS) + " |")
    print("|" + "---|" * (3 + len(GROUPS)))
    for window_text, seed, run in runs:
        by = run.get("tau_by_context") or {}
        cells = [
            f"{by[g]['served']['tau']:.3f} / {by[g]['offline']['tau']:.3f}"
            if g in by and by[g]["served"] and by[g]["offline"]
            else "–"
            for g in GROUPS
        ]
        print(f"| {window_text} | {seed} | {run['k']} | " + " | ".join(cells) + " |")


def reuse_replies(out: Path, config_path: Path) -> None:
    """Give a new run the target's replies another run under ``out`` generated with the same generate fingerprint
    (prompts, target, settings): generate resumes over them with nothing left to ask. It is minutes a run on 2
    cores, and deterministic at T=0."""
    cfg = load_config(config_path)
    run_dir = Path(cfg.run_dir)
    if (run_dir / "generate").exists():
        return
    wanted = fingerprint(cfg, "generate")
    for marker in sorted(out.glob("*/generate/STAGE.json")):
        if json.loads(marker.read_text()).get("fingerprint") == wanted:
            shutil.copytree(marker.parent, run_dir / "generate")
            return


def target_context(target: Path) -> int:
    return int(json.loads((target / "config.json").read_text())["max_position_embeddings"])


def kept(by: dict) -> float:
    return by[">16k"]["tau"] / by["<1k"]["tau"] if ">16k" in by and "<1k" in by else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES), help="the drafter family trained")
    p.add_argument(
        "--windows",
        default="none,256",
        help="comma-separated: none (full attention), auto (eaglekit's default) or a window",
    )
    p.add_argument("--seeds", default="0")
    p.add_argument("--k", default="3", help="comma-separated draft lengths evaluated on each trained drafter")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--train-prompts", type=int, default=160)
    p.add_argument("--per-group", type=int, default=3)
    p.add_argument("--long-rows", default="0,0", help="M,N: add M training prompts of 4-16k and N of >16k")
    p.add_argument("--served", action="store_true", help="also serve each drafter in vLLM (verify) per group")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    target = ensure_long_target()
    long_rows = dict(zip(LONG_TRAIN_SEEDS, (int(n) for n in args.long_rows.split(",")), strict=True))
    train_file, eval_file = write_prompts(args.out, args.train_prompts, args.per_group, long_rows)
    trains_long = any(long_rows.values())
    # long rows are kept whole: prepare cuts at the target's own context, as a user serving it long would set
    max_length = target_context(target) if trains_long else 2048
    suffix = "-long" if trains_long else ""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cli = [sys.executable, "-c", "import sys; from eaglekit.cli import main; sys.argv[0] = 'eaglekit'; main()"]
    rows, served = [], []
    for window_text in args.windows.split(","):
        window: int | str | None = window_text if window_text == "auto" else None
        if window_text not in ("none", "auto"):
            window = int(window_text)
        for seed in (int(s) for s in args.seeds.split(",")):
            name = f"window-{window_text}{suffix}-seed-{seed}"
            path = args.out / f"{name}.yaml"
            report_path = args.out / name / "evaluate" / "report.json"
            if not report_path.exists():  # a finished run is read again, so seeds run apart aggregate here
                path.write_text(yaml.safe_dump(config(target, train_file, eval_file, args.out / name, window, seed,
                                                      ks, args.steps, args.family, max_length)))  # fmt: skip
                reuse_replies(args.out, path)
                subprocess.run([*cli, "run", str(path), "--until", "evaluate"], env=env, check=True)
            report = json.loads(report_path.read_text())
            for row in (r for r in report["results"] if r["method"] == "eagle" and r["k"] in ks):
                rows.append((window_text, seed, row))
                print(json.dumps({"window": window_text, "seed": seed, "k": row["k"], "tau": row["tau"],
                                  "tau_by_context": row["tau_by_context"]}), flush=True)  # fmt: skip
            served_path = args.out / name / "verify" / "report.json"
            if args.served and not served_path.exists():
                subprocess.run([*cli, "run", str(path), "--until", "export"], env=env, check=True)
                subprocess.run([*cli, "verify", str(path)], env=env, check=False)  # its figures, pass or fail
            if args.served:
                for run in json.loads(served_path.read_text())["runs"]:
                    served.append((window_text, seed, run))
    print_tables(rows, ks)
    if served:
        print_served(served)


if __name__ == "__main__":
    main()

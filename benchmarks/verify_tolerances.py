"""The measurements behind verify's default tolerances: served against offline acceptance on a demo run's
drafter, as exported (float32 and bfloat16), and with the two config mistakes the tests make on purpose.

    python benchmarks/verify_tolerances.py runs/demo [--out /tmp/verify-tolerances] [--k 1 3 5]

Needs the vLLM environment (`bash scripts/setup.sh --vllm`). Each variant is a fresh run directory under --out
that exports the demo's trained checkpoint, edits its config.json, and runs `verify` with
`verify.engine: vllm` on 8 held-out prompts (96 new tokens): one vLLM start per variant and K.
Prints one row per variant and K: τ served / offline, the largest per-position difference, and on how
many prompts every verify pass matched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import yaml

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.rundir import RunDir
from eaglekit.tiny import write_prompts


def shift_aux(raw: dict) -> None:
    raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in raw["eagle_aux_hidden_state_layer_ids"]]
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ]


def flip_norm(raw: dict) -> None:
    raw["norm_before_residual"] = not raw["norm_before_residual"]


VARIANTS = {  # name: (form, dtype, edit of the exported config.json)
    "float32": ("eagle3", "float32", None),
    "bfloat16": ("eagle3", "bfloat16", None),
    "aux ids shifted by one": ("eagle3", "float32", shift_aux),
    "norm_before_residual flipped": ("speculators", "float32", flip_norm),
}


def measure(demo: Path, out: Path, name: str, ks: list[int]) -> dict:
    form, dtype, edit = VARIANTS[name]
    base = yaml.safe_load((demo / "config.yaml").read_text())
    root = out / name.replace(" ", "-")
    root.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(root / "heldout.jsonl", 8, seed=77)
    doc = {
        **base,
        "run_dir": str(root / "run"),
        "target": {**base["target"], "dtype": dtype},
        "data": {**base["data"], "prompts": str((demo / base["data"]["prompts"]).resolve())},
        "evaluate": {
            **base["evaluate"],
            "checkpoint": str(demo / "train" / "checkpoints" / "best"),
            "prompts": str(prompts),
            "num_samples": 8,
            "max_new_tokens": 96,
        },
        "export": {"formats": [form]},
        "verify": {"engine": "vllm", "num_speculative_tokens": ks, "engine_args": ["--dtype", dtype]},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(doc))
    cfg = load_config(root / "config.yaml")
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True, force=True)
        if edit:
            path = cfg.run_path / "export" / form / "config.json"
            raw = json.loads(path.read_text())
            edit(raw)
            path.write_text(json.dumps(raw, indent=2))
        # a FAIL is what the broken variants are for; the report is written either way
        with contextlib.suppress(EaglekitError):
            pipeline.run_stage(cfg, "verify", skip_preflight=True, force=True)
    return json.loads((cfg.run_path / "verify" / "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", type=Path, help="a finished `eaglekit demo` run directory")
    parser.add_argument("--out", type=Path, default=Path("/tmp/verify-tolerances"))
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    rows = []
    for name in args.variants:
        report = measure(args.demo.resolve(), args.out, name, args.k)
        for r in report["runs"]:
            rounds = r["rounds"] or {}
            rows.append(
                f"| {name} | {r['form']} | {r['k']} | {r['tau']['served']:.3f} / {r['tau']['offline']:.3f} | "
                f"{r['tau']['relative_difference']:.1%} | {r['largest_position_difference']:.3f} | "
                f"{rounds.get('identical', '-')}/{rounds.get('compared', '-')} | "
                f"{r['greedy']['identical']}/{r['greedy']['prompts']} | {'pass' if r['passed'] else 'FAIL'} |"
            )
    print(
        "| variant | form | K | τ served / offline | τ Δ | largest position Δ | prompts with every pass equal "
        "| greedy identical | verify |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

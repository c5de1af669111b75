"""Offline features: bytes per token, extraction throughput vs the target's forward alone, τ of fp8 vs bf16.

One run, on the demo's data (the built-in tiny target, the demo's prompts and settings):

1. The demo's generate, prepare and vocab stages once (``RUN/base``).
2. Bytes per token, exactly:
   - eaglekit bf16 and fp8: the shards the extract stage writes (``index.json``: bytes / tokens), and the
     same layout computed for a Kimi-K2-sized target (H = 7168) from the shard plan (headers included);
   - SpecForge's per-sample layout (``scripts/prepare_hidden_states.py``: one ``torch.save`` of
     ``asdict(DataPoint(input_ids, loss_mask, hidden_state [1, L, H], aux_hidden_state [1, L, 3H]))`` per
     sample, ``data_{idx}.ckpt``): every demo sample really saved, one at a time, and its file size read —
     for the tiny target's H and for H = 7168. Unpadded (batch size 1): SpecForge's best case; with larger
     batches it saves ``input_ids``/``loss_mask`` padded to the batch's longest sample.
3. Throughput on the same prepared tokens and the same batches: the target's forward alone (no copy, no
   encode, no disk) against the whole extract stage (forward, encode, background writer, commit), bf16 and
   fp8, interleaved, ``--rounds`` times; medians and their ratio.
4. τ: the demo's train and evaluate from bf16 features, from fp8 features, and online (the live target).

    .venv/bin/python benchmarks/features.py --out runs/bench-features     # ~8 minutes on 2 CPU cores

Prints a summary and writes ``RUN/features.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

KIMI_HIDDEN = 7168


@dataclass
class DataPoint:  # SpecForge's scripts/prepare_hidden_states.py, field for field
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_state: torch.Tensor
    aux_hidden_state: torch.Tensor | None = None


def specforge_bytes(lengths: list[int], hidden: int, dtype=torch.bfloat16) -> int:
    """Total size of SpecForge's per-sample files for these lengths: each one saved and measured."""
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        for idx, length in enumerate(lengths):
            point = DataPoint(
                torch.zeros(length, dtype=torch.long),
                torch.zeros(length, dtype=torch.long),
                torch.zeros(1, length, hidden, dtype=dtype),
                torch.zeros(1, length, 3 * hidden, dtype=dtype),
            )
            path = Path(tmp) / f"data_{idx}.ckpt"
            torch.save(asdict(point), path)
            total += path.stat().st_size
            path.unlink()
    return total


def eaglekit_bytes(store, lengths: list[int], plan: list[list[int]], hidden: int, dtype: str) -> int:
    """Total size of eaglekit's shards for this plan (exact: header, rows, offsets), without writing them."""
    from eaglekit.data import shards as sh
    from eaglekit.stages.extract import _shard_meta

    meta = _shard_meta(hidden, [2, 4, 5], "hf")
    return sum(sh.shard_bytes([store.ids[i] for i in s], sum(lengths[i] for i in s), hidden, dtype, meta) for s in plan)


def load(path: Path):
    from eaglekit.config import load_config

    return load_config(path)


def set_config(run: Path, **sections) -> None:
    data = yaml.safe_load((run / "config.yaml").read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def stages(run: Path, names: list[str], force: bool = False) -> dict:
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir

    cfg = load(run / "config.yaml")
    out = {}
    with RunDir(cfg.run_dir).lock:
        for name in names:
            out[name] = run_stage(cfg, name, force=force, skip_preflight=True)
    return out


def forward_only(run: Path) -> float:
    """Tokens/s of the target's forward over extract's own batches, nothing else."""
    from eaglekit.data import shards as sh
    from eaglekit.data.tokens import TokenStore
    from eaglekit.model.target import TargetFeatures, load_target
    from eaglekit.training.data import pad

    cfg = load(run / "config.yaml")
    store = TokenStore(run / "prepare" / "tokens.safetensors")
    lengths = store.lengths.tolist()
    target = TargetFeatures(load_target(cfg.target), [2, 4, 5])
    batches = [
        b
        for s in sh.plan_shards(lengths, cfg.extract.shard_tokens)
        for b in sh.plan_batches(s, lengths, cfg.extract.batch_tokens)
    ]
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            ids = [store[i][1] for i in batch]
            target(pad(ids), pad([torch.ones_like(t) for t in ids]), with_logits=False)
    return sum(lengths) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-features"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None, help="prompts (default: the demo's 400)")
    parser.add_argument("--skip-tau", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the demo: the tiny target gains nothing from intra-op threads on 2 cores

    from eaglekit.data import shards as sh
    from eaglekit.data.tokens import TokenStore
    from eaglekit.demo import DEMO_SAMPLES, demo_config
    from eaglekit.tiny import ensure_tiny_target, write_prompts

    root = args.out.resolve()
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    target = ensure_tiny_target()
    if not (base / "prompts.jsonl").exists():
        write_prompts(base / "prompts.jsonl", n=args.samples or DEMO_SAMPLES, seed=1234)
    if not (base / "config.yaml").exists():
        config = demo_config(target, offline=True)
        (base / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    stages(base, ["generate", "prepare", "vocab"])
    runs = {}
    for name, extract in (
        ("bf16", {"mode": "offline", "dtype": "bfloat16"}),
        ("fp8", {"mode": "offline", "dtype": "fp8"}),
        ("online", {"mode": "online"}),
    ):
        run = root / name
        if not run.exists():
            shutil.copytree(base, run, ignore=shutil.ignore_patterns(".lock"))
            set_config(run, extract=extract)
        runs[name] = run

    # --- bytes per token ----------------------------------------------------------------------------
    store = TokenStore(base / "prepare" / "tokens.safetensors")
    lengths = store.lengths.tolist()
    tokens = sum(lengths)
    cfg = load(base / "config.yaml")
    plan = sh.plan_shards(lengths, cfg.extract.shard_tokens)
    hidden = 128
    written = {}
    for name in ("bf16", "fp8"):
        stages(runs[name], ["extract"])
        index = json.loads((runs[name] / "extract" / "index.json").read_text())
        written[name] = index["bytes"]
        assert index["bytes"] == eaglekit_bytes(store, lengths, plan, hidden, index["dtype"])  # the formula is exact
    sizes = {
        "tiny": {
            "hidden": hidden,
            "eaglekit_bf16": written["bf16"],
            "eaglekit_fp8": written["fp8"],
            "specforge": specforge_bytes(lengths, hidden),
        },
        "kimi": {
            "hidden": KIMI_HIDDEN,
            "eaglekit_bf16": eaglekit_bytes(store, lengths, plan, KIMI_HIDDEN, "bfloat16"),
            "eaglekit_fp8": eaglekit_bytes(store, lengths, plan, KIMI_HIDDEN, "fp8"),
            "specforge": specforge_bytes(lengths, KIMI_HIDDEN),
        },
    }
    for row in sizes.values():
        row["per_token"] = {k: round(row[k] / tokens, 2) for k in ("eaglekit_bf16", "eaglekit_fp8", "specforge")}
        row["fp8_over_specforge"] = round(row["eaglekit_fp8"] / row["specforge"], 4)
        row["bf16_over_specforge"] = round(row["eaglekit_bf16"] / row["specforge"], 4)
        row["fp8_over_bf16"] = round(row["eaglekit_fp8"] / row["eaglekit_bf16"], 4)
    token_store = (base / "prepare" / "tokens.safetensors").stat().st_size

    # --- throughput ---------------------------------------------------------------------------------
    rates = {"forward": [], "bf16": [], "fp8": []}
    for _ in range(args.rounds):
        rates["forward"].append(forward_only(base))
        for name in ("bf16", "fp8"):
            row = stages(runs[name], ["extract"], force=True)["extract"]
            rates[name].append(row["counts"]["tokens_per_s"])
    medians = {k: statistics.median(v) for k, v in rates.items()}
    throughput = {
        "tokens": tokens,
        "rounds": rates,
        "median_tokens_per_s": medians,
        "bf16_over_forward": round(medians["bf16"] / medians["forward"], 3),
        "fp8_over_forward": round(medians["fp8"] / medians["forward"], 3),
    }

    # --- τ ------------------------------------------------------------------------------------------
    tau = {}
    if not args.skip_tau:
        for name in ("bf16", "fp8", "online"):
            out = stages(runs[name], ["train", "evaluate"])
            report = json.loads((runs[name] / "evaluate" / "report.json").read_text())
            tau[name] = {
                "held_out_simulated": out["train"]["counts"].get("tau")
                if "counts" in out["train"]
                else json.loads((runs[name] / "train" / "summary.json").read_text())["tau"],
                "evaluate": {
                    f"K={r['k']} T={r['temperature']:g}": r["tau"] for r in report["results"] if r["method"] == "eagle"
                },
            }
        tau["fp8_over_bf16"] = {
            k: round(tau["fp8"]["evaluate"][k] / tau["bf16"]["evaluate"][k], 4) for k in tau["bf16"]["evaluate"]
        }

    result = {
        "samples": len(store),
        "tokens": tokens,
        "token_store_bytes": token_store,
        "bytes": sizes,
        "throughput": throughput,
        "tau": tau,
        "torch": torch.__version__,
    }
    (root / "features.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())

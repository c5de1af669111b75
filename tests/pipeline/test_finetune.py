"""Finetuning that does not over-specialise: evaluate measures the untouched starting drafter beside the finetune,
and train.ttt.anchor_weight pulls the finetune toward its start. On the tiny target: a drafter trained on one task mix
(arithmetic), finetuned on another (sorting, vowel counting, unit conversion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglekit.config import parse_config
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.tiny.corpus import sample_tasks, write_responses

pytestmark = pytest.mark.slow  # builds, trains or serves models

ARITHMETIC = ("add", "subtract", "compare")
WORDS_AND_LISTS = ("sort", "count", "convert")
TRAIN = {
    "ttt": {"steps": 3},
    "batch_size": 8,
    "lr": 6e-3,
    "warmup_steps": 5,
    "max_steps": 40,
    "eval_every": 40,
    "save_every": 40,
    "log_every": 10,
    "eval_samples": 16,
    "draft": {"intermediate_size": 256},
}
EVALUATE = {"num_samples": 6, "num_speculative_tokens": [3], "temperatures": [0.0], "max_new_tokens": 64}


def tasks(kinds, n, seed, split="train"):
    out = [t for t in sample_tasks(4 * n, seed, split=split) if t.kind in kinds]
    assert len(out) >= n
    return out[:n]


def run_on(tmp_path: Path, target: Path, kinds, seed: int, train: dict, evaluate: dict | None = None):
    """A run directory whose generate, prepare and vocab are done, on tasks of ``kinds`` only."""
    gen = tmp_path / "run" / "generate"
    write_responses(gen, tasks(kinds, 160, seed), f"t{seed}-")
    cfg = parse_config(
        {
            "run_dir": "run",
            "target": {"model": str(target)},
            "data": {"prompts": "unused.jsonl", "eval_fraction": 0.1},
            "vocab": {"draft_vocab_size": 200},
            "train": train,
            "evaluate": {**EVALUATE, **(evaluate or {})},
        },
        base_dir=tmp_path,
    )
    with RunDir(cfg.run_dir).lock:
        for stage in ("prepare", "vocab"):
            run_stage(cfg, stage, skip_preflight=True)
    return cfg


def stage(cfg, name):
    with RunDir(cfg.run_dir).lock:
        return run_stage(cfg, name)


def test_evaluate_measures_the_finetune_beside_its_start_and_the_anchor_holds_it_back(tmp_path, tiny_target):
    start = run_on(tmp_path / "arith", tiny_target, ARITHMETIC, seed=1, train=TRAIN)
    stage(start, "train")
    start_drafter = Path(start.run_dir) / "train" / "checkpoints" / "best"

    production = tmp_path / "arithmetic-traffic.jsonl"  # what the server will see: the start's own kind of prompts
    production.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t.prompt}]}) + "\n"
            for i, t in enumerate(tasks(ARITHMETIC, 6, seed=5, split="heldout"))
        )
    )
    figures = {}
    for name, anchor in (("plain", 0.0), ("anchored", 50.0)):
        cfg = run_on(
            tmp_path / name,
            tiny_target,
            WORDS_AND_LISTS,
            seed=2,
            train={**TRAIN, "init_from": str(start_drafter), "ttt": {"steps": 3, "anchor_weight": anchor}},
            evaluate={"prompts": str(production)},
        )
        stage(cfg, "train")
        row = stage(cfg, "evaluate")
        report = json.loads((Path(cfg.run_dir) / "evaluate" / "report.json").read_text())
        metrics = [
            json.loads(line) for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()
        ]
        figures[name] = (report, row, metrics)
        print(name, report["finetune"]["verdict"], [(s["prompts"], s["rows"]) for s in report["finetune"]["sets"]])

    report, row, metrics = figures["plain"]
    sets = {s["prompts"]: s for s in report["finetune"]["sets"]}
    heldout, traffic = sets["held-out split of generate/responses.jsonl"], sets[str(production)]
    # the finetune wins on the data it was finetuned on and loses on the traffic the start was made for
    assert heldout["better"] == "finetuned" and heldout["count"] >= 4
    assert traffic["better"] == "starting drafter" and traffic["count"] == 6
    assert "over-specialised" in report["finetune"]["verdict"]
    # a degenerate outcome: a warning of the stage (ledger, status, export), not only a line in the report
    assert report["finetune"]["verdict"] in row["warnings"] and report["finetune"]["verdict"] in report["warnings"]
    assert row["counts"]["finetune_vs_start"][str(production)] == traffic["mean_ratio"] < 1
    # the main table holds both drafters (and n-gram) on evaluate.prompts
    assert {r["method"] for r in report["results"]} == {"eagle", "eagle_start", "ngram"}
    md = (Path(report["checkpoint"]).parents[2] / "evaluate" / "report.md").read_text()
    assert "Finetuned drafter vs the drafter it started from" in md and "over-specialised" in md
    assert all("anchor_distance" not in r for r in metrics)

    anchored_report, _, anchored_metrics = figures["anchored"]
    anchored = {s["prompts"]: s for s in anchored_report["finetune"]["sets"]}
    distance = [r["anchor_distance"] for r in anchored_metrics if r["kind"] == "train"]
    assert distance and all(d > 0 for d in distance)
    # the pull keeps the finetune closer to where it started, and better on the start's own traffic
    assert anchored[str(production)]["mean_ratio"] > traffic["mean_ratio"]

"""`eaglekit run` with `train.draft.architecture: dflash` on the tiny target, from one config: train (the shared
loop with the block objective), evaluate (block drafting, lossless at T=0), export (vLLM's dflash form) and verify
in the real vLLM CPU build (one engine start: served τ, every position and every verify pass equal to offline);
then the exported drafter re-imported with `train.init_from` and finetuned from offline shards in packed rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def dflash_config(run_dir: Path, target: Path, **train) -> dict:
    from eaglekit.demo import demo_config

    cfg = demo_config(target)
    cfg["data"]["prompts"] = str(run_dir.parent / "prompts.jsonl")
    cfg["run_dir"] = str(run_dir)
    cfg["train"].update(
        {
            "max_steps": 120,
            "batch_size": 8,
            "lr": 1e-3,
            "eval_every": 60,
            "save_every": 60,
            # shared_k_norm: what vLLM's CPU build serves exactly (docs/drafters.md: "DFlash and DSpark on the vLLM CPU build")
            "draft": {"architecture": "dflash", "num_layers": 2, "block_size": 4, "shared_k_norm": True},
            **train,
        }
    )
    cfg["evaluate"].update({"num_speculative_tokens": [1, 3], "num_samples": 4})
    cfg.pop("verify", None)
    return cfg


def run(cfg: dict, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(path)], capture_output=True, text=True, timeout=1500
    )


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory, tiny_target, vllm_python):
    from eaglekit.tiny import write_prompts

    root = tmp_path_factory.mktemp("dflash-run")
    write_prompts(root / "prompts.jsonl", 120, seed=0)
    cfg = dflash_config(root / "run", tiny_target)
    cfg["verify"] = {"engine": "vllm", "num_samples": 4, "python": str(vllm_python)}
    proc = run(cfg, root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, root / "run"


def test_run_trains_evaluates_exports_and_verifies_a_dflash_drafter(dflash_run):
    _, run_dir = dflash_run
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert summary["tau"] > 1.8  # the loop's held-out block τ: the drafter learned to draft
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert report["lossless"] and report["checkpoint_form"] == "dflash"
    taus = {(r["method"], r["k"]): r["tau"] for r in report["results"] if r["temperature"] == 0}
    assert taus["eagle", 3] > taus["eagle", 1] > taus["ngram", 1]  # "eagle": the run's drafter, whatever its family
    exported = json.loads((run_dir / "export" / "dflash" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"]

    verify = json.loads((run_dir / "verify" / "report.json").read_text())
    assert verify["verdict"] == "PASS", verify
    (served,) = verify["runs"]
    assert served["form"] == "dflash" and served["k"] == 3
    assert served["tau"]["served"] == served["tau"]["offline"]
    assert served["rounds"]["compared"] == served["rounds"]["identical"] > 0  # every verify pass, when reported
    assert '"method": "dflash"' in served["launch"]


def test_an_exported_dflash_drafter_is_reimported_for_finetuning(dflash_run, tiny_target):
    start, finetuned = finetune_from_export(*dflash_run, tiny_target, dflash_config, "dflash")
    assert start[3] > 2.0  # it arrived with its trained weights, not re-initialised
    assert finetuned[3] > 0.9 * start[3]  # packed offline rows kept what the drafter knew


def finetune_from_export(root: Path, first: Path, tiny_target, make_config, form: str):
    """Finetune the drafter exported to first/export/FORM from offline feature shards with packed rows (the data
    paths EAGLE-3 has, for the block families); returns evaluate's τ per K at T=0 of the re-imported starting
    drafter (measured beside the finetuned one) and of the finetuned one."""
    cfg = make_config(
        root / "finetune", tiny_target, max_steps=12, init_from=str(first / "export" / form), packing=True
    )
    cfg["train"].pop("draft")  # init_from keeps the exported drafter's own shape
    cfg["extract"] = {"mode": "offline"}
    proc = run(cfg, root / "finetune-cfg")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((root / "finetune" / "evaluate" / "report.json").read_text())
    assert report["lossless"] and report["checkpoint_form"] == form
    assert list((root / "finetune" / "extract").glob("shard-*.safetensors"))  # trained from the offline shards
    start = {r["k"]: r["tau"] for r in report["results"] if r["method"] == "eagle_start"}
    finetuned = {r["k"]: r["tau"] for r in report["results"] if r["method"] == "eagle" and r["temperature"] == 0}
    assert start and finetuned
    return start, finetuned

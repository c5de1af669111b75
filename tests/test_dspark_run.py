"""`eaglekit run` with `train.draft.architecture: dspark` on the tiny target, from one config: train (the shared loop
with the block objective), evaluate (DSpark block drafting, lossless at T=0), export (vLLM's dspark form); verify on
the CPU build of vLLM is a named refusal before any engine starts; the export re-imported with `train.init_from`
and finetuned from offline shards in packed rows. And kill -9 resume of both block families: a resumed run equals
an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_dflash_run import dflash_config, finetune_from_export, run
from test_extract import prepared_run
from test_train import kill_9_then_resume

pytestmark = pytest.mark.slow  # trains drafters, starts vLLM's config machinery

DSPARK = {"architecture": "dspark", "num_layers": 2, "block_size": 4, "markov_rank": 32}


def dspark_config(run_dir: Path, target: Path, **train) -> dict:
    cfg = dflash_config(run_dir, target, **train)
    if "draft" in cfg["train"]:
        cfg["train"]["draft"] = dict(DSPARK)
    cfg["evaluate"]["num_speculative_tokens"] = [1, 4]
    return cfg


@pytest.fixture(scope="module")
def dspark_run(tmp_path_factory, tiny_target):
    from eaglekit.tiny import write_prompts

    root = tmp_path_factory.mktemp("dspark-run")
    write_prompts(root / "prompts.jsonl", 120, seed=0)
    proc = run(dspark_config(root / "run", tiny_target), root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, root / "run"


def test_run_trains_evaluates_and_exports_a_dspark_drafter(dspark_run):
    _, run_dir = dspark_run
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert summary["tau"] > 1.8  # the loop's held-out block τ: the drafter learned to draft
    assert len(summary["acc_k"]) == 4  # every slot of the block drafts, the anchor's included
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert report["lossless"] and report["checkpoint_form"] == "dspark"
    taus = {(r["method"], r["k"]): r["tau"] for r in report["results"] if r["temperature"] == 0}
    assert taus["eagle", 4] > taus["eagle", 1] > taus["ngram", 1]  # "eagle": the run's drafter, whatever its family
    exported = json.loads((run_dir / "export" / "dspark" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3DSparkModel"] and exported["markov_rank"] == 32
    assert '"method": "dspark"' in (run_dir / "export" / "README.md").read_text()


def test_verify_on_the_cpu_build_is_a_named_refusal(dspark_run, tiny_target, vllm_python):
    root, run_dir = dspark_run
    cfg = dspark_config(run_dir, tiny_target)
    cfg["verify"] = {"engine": "vllm", "num_samples": 4, "python": str(vllm_python)}
    proc = run(cfg, root / "verify-cfg")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "Model Runner V1 does not support: dspark speculative decoding" in out
    assert "Triton" in out and not (run_dir / "verify" / "logs").exists()  # refused before any engine started


def test_an_exported_dspark_drafter_is_reimported_for_finetuning(dspark_run, tiny_target):
    start, finetuned = finetune_from_export(*dspark_run, tiny_target, dspark_config, "dspark")
    assert start[4] > 2.0  # it arrived with its trained weights, not re-initialised
    assert finetuned[4] > 0.9 * start[4]  # packed offline rows kept what the drafter knew


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_kill_9_resume_of_a_block_drafter_equals_an_uninterrupted_run(tmp_path, tiny_target, family):
    """The anchors are drawn from the global RNG, which a checkpoint restores: the resumed run draws the same blocks
    and takes the same steps."""
    draft = {"architecture": family, "num_layers": 1, "block_size": 4, "max_anchors": 16}
    if family == "dspark":
        draft["markov_rank"] = 8
    settings = {
        "batch_size": 4, "lr": 1e-3, "warmup_steps": 2, "eval_samples": 8, "max_steps": 7, "save_every": 3,
        "eval_every": 2, "log_every": 1, "keep_last": 2, "draft": draft,
    }  # fmt: skip
    whole = prepared_run(tmp_path / "whole", tiny_target, n=32, train=settings)
    killed = prepared_run(tmp_path / "killed", tiny_target, n=32, train=settings)
    _, wa, wb = kill_9_then_resume(whole, killed, ("loss", "loss_k", "acc_k", "tau", "lr", "grad_norm"))
    assert wa.keys() == wb.keys() and (family != "dspark" or "markov_head.markov_w1.weight" in wa)

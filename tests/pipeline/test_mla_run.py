"""A DeepSeek-V3-shaped run end to end with the MLA drafter: pre-flight, train, evaluate, export, import."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_extract import prepared_run

from eaglekit import pipeline
from eaglekit.drafters.eagle3.checkpoint import load_drafter
from eaglekit.rundir import RunDir
from eaglekit.stages import verify

pytestmark = pytest.mark.slow  # builds, trains or serves models

TRAIN = {
    "ttt": {"steps": 3},
    "batch_size": 8,
    "lr": 6e-3,
    "warmup_steps": 5,
    "max_steps": 30,
    "eval_every": 30,
    "save_every": 30,
    "log_every": 10,
    "eval_samples": 16,
}


def preflight(cfg, stage: str) -> dict:
    return {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, stage))}


def test_mla_drafter_trains_evaluates_and_exports(tmp_path, tiny_deepseek_target):
    cfg = prepared_run(
        tmp_path,
        tiny_deepseek_target,
        n=120,
        train={**TRAIN, "draft": {"architecture": "mla", "fc_norm": True, "norm_output": True}},
        evaluate={"num_samples": 3, "num_speculative_tokens": [3], "temperatures": [0.0], "max_new_tokens": 48},
        export={"num_speculative_tokens": 3},
    )
    drafter_check = preflight(cfg, "train")["drafter"]
    assert drafter_check.status == "ok", drafter_check
    assert (
        "mla: q_lora_rank 32, kv_lora_rank 512" in drafter_check.detail
        and "fc_norm, norm_output" in drafter_check.detail
    )

    with RunDir(cfg.run_dir).lock:
        trained = pipeline.run_stage(cfg, "train", skip_preflight=True)
        evaluated = pipeline.run_stage(cfg, "evaluate")
        exported = pipeline.run_stage(cfg, "export")
    run = Path(cfg.run_dir)
    evals = [
        json.loads(line)
        for line in (run / "train" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    print("held-out acc_k", evals[0]["acc_k"], "->", evals[-1]["acc_k"], trained["counts"], evaluated["counts"])
    assert evals[-1]["acc_k"][0] > evals[0]["acc_k"][0] + 0.2  # it learns

    best, info = load_drafter(run / "train" / "checkpoints" / "best")
    c = best.config
    assert info.form == "legacy" and c.architecture == "mla" and c.fc_norm and c.norm_output
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim) == (32, 512, 64)  # the target's latent shapes

    report = json.loads((run / "evaluate" / "report.json").read_text())
    assert report["lossless"] is True
    eagle = next(r for r in report["results"] if r["method"] == "eagle")
    assert 1.0 <= eagle["tau"] <= 4.0

    # The plain form only, with the reason the speculators form is missing; loaded back, the same drafter.
    assert exported["counts"]["formats"] == ["eagle3"] and exported["counts"]["warnings"] == 1
    out = run / "export" / "eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert not (run / "export" / "speculators").exists()
    card = (run / "export" / "README.md").read_text()
    assert "no speculators form" in card and "multi-head latent attention" in card and "sglang" in card.lower()
    assert all(
        k.startswith(("layers.0.", "fc", "norm", "lm_head", "d2t", "t2d", "embed_tokens"))
        for k in load_file(str(out / "model.safetensors"))
    )
    exported_drafter, _ = load_drafter(out)
    assert exported_drafter.config == c
    for name, tensor in best.state_dict().items():
        assert torch.equal(exported_drafter.state_dict()[name], tensor), name

    # verify serves what export wrote (the plain form only), and reads the MLA export as each engine does
    assert verify.forms(cfg) == ["eagle3"]
    aux = c.aux_layer_ids
    for engine in ("vllm", "sglang"):  # fc_norm and norm_output: both engines read them
        rows = {row["cause"]: row for row in verify.diagnose(cfg, out, engine, aux)}
        assert all(row["status"] == "ok" for row in rows.values()), (engine, rows)
        assert "fc_norm true, norm_output true" in rows["EAGLE 3.1 flags"]["detail"]
    config["norm_output"] = False  # a config edited by hand: the engine would feed steps 2.. the pre-norm output
    (out / "config.json").write_text(json.dumps(config))
    rows = {row["cause"]: row for row in verify.diagnose(cfg, out, "vllm", aux)}
    assert [cause for cause, row in rows.items() if row["status"] == "suspect"] == ["EAGLE 3.1 flags"]
    assert "norm_output false (trained true)" in rows["EAGLE 3.1 flags"]["detail"]


def test_mla_export_for_vllm_alone_when_sglang_cannot_read_its_aux_ids(tmp_path, tiny_deepseek_target):
    """Aux layers not starting at 2 mean other layers in SGLang's versions: a Llama drafter's plain form is refused
    (its speculators form serves vLLM), an MLA drafter's only form is written without eagle_config, for vLLM."""
    cfg = prepared_run(
        tmp_path,
        tiny_deepseek_target,
        n=24,
        export={"formats": ["eagle3"]},
        train={**TRAIN, "max_steps": 2, "eval_every": 2, "save_every": 2, "draft": {"architecture": "mla"}},
    )
    cfg.target.aux_layers = [3, 4, 5]  # features are captured during training (online mode)
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "train", skip_preflight=True)
    check = preflight(cfg, "export")["SGLang aux layers"]
    assert check.status == "warn" and "vLLM alone" in check.detail and "vLLM" in check.remedy
    with RunDir(cfg.run_dir).lock:
        exported = pipeline.run_stage(cfg, "export", skip_preflight=True)
    assert exported["counts"]["formats"] == ["eagle3"]
    out = Path(cfg.run_dir) / "export" / "eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5] and "eagle_config" not in config
    card = (Path(cfg.run_dir) / "export" / "README.md").read_text()
    assert "sglang.launch_server" not in card and "no SGLang command" in card
    assert verify.diagnose(cfg, out, "vllm", [3, 4, 5])[0]["status"] == "ok"  # vLLM captures the trained layers
    assert verify.diagnose(cfg, out, "sglang", [3, 4, 5])[0]["status"] == "suspect"  # SGLang its defaults


def test_preflight_suggests_mla_for_an_mla_target(tmp_path, tiny_deepseek_target):
    cfg = prepared_run(tmp_path, tiny_deepseek_target, n=24)
    check = preflight(cfg, "train")["drafter"]
    assert check.status == "warn" and "multi-head latent attention" in check.detail
    assert "train.draft.architecture: mla" in check.remedy
    cfg.train.draft = {"architecture": "llama"}  # chosen explicitly: no warning
    assert preflight(cfg, "train")["drafter"].status == "ok"
    cfg.train.draft = {"architecture": "mla"}
    with pytest.raises(ValueError, match=r"architecture mla does not read norm_before_fc \(peagle, llama\)"):
        cfg.train.draft.norm_before_fc = True  # no MLA drafter of either engine has input_norm: refused as it is set


def test_an_exported_mla_drafter_is_finetuned_on_a_new_vocab(tmp_path, tiny_deepseek_target):
    """The export of one run is the init_from of the next: shape and flags kept, lm_head remapped, train.draft ignored."""
    first = prepared_run(
        tmp_path / "first",
        tiny_deepseek_target,
        n=48,
        train={
            **TRAIN,
            "max_steps": 4,
            "eval_every": 4,
            "save_every": 4,
            "draft": {"architecture": "mla", "fc_norm": True, "norm_before_residual": True},
        },
    )
    with RunDir(first.run_dir).lock:
        pipeline.run_stage(first, "train", skip_preflight=True)
    published = Path(first.run_dir) / "train" / "checkpoints" / "best"
    second = prepared_run(
        tmp_path / "second",
        tiny_deepseek_target,
        n=48,
        seed=2,
        vocab={"draft_vocab_size": 150},
        train={
            **TRAIN,
            "max_steps": 2,
            "eval_every": 2,
            "save_every": 2,
            "init_from": str(published),
            "remap_vocab": True,
            "draft": {"norm_output": True},
        },
    )
    checks = preflight(second, "train")
    assert checks["init_from"].status == "ok" and "mla drafter" in checks["init_from"].detail
    assert checks["drafter"].status == "warn" and "norm_output" in checks["drafter"].detail
    with RunDir(second.run_dir).lock:
        row = pipeline.run_stage(second, "train", skip_preflight=True)
    assert row["counts"]["draft_vocab"] == "vocab stage (remapped)"
    tuned, _ = load_drafter(Path(second.run_dir) / "train" / "checkpoints" / "best")
    source, _ = load_drafter(published)
    assert tuned.config.draft_vocab_size == 150 and source.config.draft_vocab_size == 200
    assert tuned.config == dataclasses.replace(source.config, draft_vocab_size=150)  # flags and shapes kept
    assert not tuned.config.norm_output

"""The stage contract: each stage's declaration is what the run order, the upstream a stage reads, `status`, the
pre-flight disk check and `eaglekit plan` use — so a new stage is its module plus one line in STAGE_ORDER."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from support.helpers import write_config

from eaglekit import pipeline, status
from eaglekit.config import load_config
from eaglekit.contract import Estimate, Stage
from eaglekit.preflight import disk
from eaglekit.progress import human_bytes

BASE = {"run_dir": "run", "target": {"model": "model"}, "data": {"prompts": "prompts.jsonl"}}


def config(tmp_path, **sections):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    return load_config(write_config(tmp_path / "c.yaml", {**BASE, **sections}))


def test_every_stage_declares_itself_and_reads_an_earlier_stage():
    for i, name in enumerate(pipeline.STAGE_ORDER):
        declared = pipeline.stage_of(name)
        assert isinstance(declared, Stage) and declared.name == name
        assert declared.upstream is None or pipeline.STAGE_ORDER.index(declared.upstream) < i, name
        assert f"{name}/" in declared.writes, f"{name}: `writes` names its folder, for --help"


def test_the_skip_rule_and_the_upstream_follow_the_declarations(tmp_path):
    online = config(tmp_path)
    assert pipeline.stages_for(online) == ["generate", "prepare", "vocab", "train", "evaluate", "export"]
    assert pipeline.upstream_of(online, "train") == "vocab"  # the skipped extract is stepped over
    offline = config(tmp_path, extract={"mode": "offline"}, verify={"engine": "vllm"})
    assert pipeline.stages_for(offline)[3] == "extract" and pipeline.stages_for(offline)[-1] == "verify"
    assert pipeline.upstream_of(offline, "train") == "extract"


def test_a_new_stage_is_one_declaration_and_one_line(tmp_path, monkeypatch):
    """A stage `distill` between export and verify, declared only: it runs, status shows its counts and flags,
    and plan sizes it with its estimate; verify (skipped in this config) would read it."""
    calls = []

    def run(ctx):
        calls.append(ctx.upstream)
        (ctx.dir / "student.bin").write_bytes(b"x")
        return {"students": 1}

    distill = Stage(
        name="distill",
        upstream="export",
        reads="export/",
        writes="distill/student.bin",
        params=lambda run: {},
        checks=lambda cfg: [],
        run=run,
        estimate=lambda ctx, sizes: Estimate(bytes=123_000_000, how=["one student"]),
        data_flags=lambda counts: [f"{counts['students']} student only"],
    )
    real = pipeline.stage_of
    order = (*pipeline.STAGE_ORDER[:-1], "distill", pipeline.STAGE_ORDER[-1])
    monkeypatch.setattr(pipeline, "STAGE_ORDER", order)
    monkeypatch.setattr(pipeline, "stage_of", lambda name: distill if name == "distill" else real(name))
    verify = real("verify")
    monkeypatch.setattr(verify, "upstream", "distill")

    cfg = config(tmp_path)
    assert pipeline.stages_for(cfg)[-1] == "distill"
    assert pipeline.upstream_of(cfg, "verify") == "distill"
    with pipeline.RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "distill", skip_preflight=True)
    assert calls == ["export"]
    row = next(r for r in status.stage_rows(cfg) if r["stage"] == "distill")
    assert row["state"] == "done" and row["counts"] == {"students": 1} and row["flags"] == ["1 student only"]

    from eaglekit import planning

    doc = planning.plan(cfg, samples=10, mean_tokens=100, free_bytes=10**12, write_bytes_per_s=1e8)
    planned = next(s for s in doc["stages"] if s["stage"] == "distill")
    assert planned["done"] and planned["bytes"] == 123_000_000 and planned["how"][-1] == "one student"


def test_pre_flight_and_plan_take_the_same_estimate(tmp_path, monkeypatch):
    cfg = config(tmp_path, vocab={"draft_vocab_size": 100})
    vocab = pipeline.stage_of("vocab")
    monkeypatch.setattr(vocab, "estimate", lambda ctx, sizes: replace(Estimate(bytes=777_000_000), files=3))
    ctx = pipeline.make_context(cfg, "vocab")
    assert f"about {human_bytes(777_000_000)} needed" in disk.disk_space(ctx).detail
    from eaglekit import planning

    doc = planning.plan(cfg, samples=10, mean_tokens=100, free_bytes=10**12, write_bytes_per_s=1e8)
    assert next(s for s in doc["stages"] if s["stage"] == "vocab")["bytes"] == 777_000_000


@pytest.mark.parametrize("hook", ["kept", "damaged", "live_counts"])
def test_optional_hooks_have_defaults_that_say_nothing(tmp_path, hook):
    cfg = config(tmp_path)
    ctx = pipeline.make_context(cfg, "vocab")  # vocab declares none of them
    arg = ctx.dir if hook == "live_counts" else ctx
    assert getattr(ctx.stage_def, hook)(arg) is None

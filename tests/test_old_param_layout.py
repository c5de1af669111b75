"""A run directory finished before train's TTT keys moved under train.ttt stays done after the upgrade.

Its ledger holds train's parameters as one flat section (ttt_steps, loss: NAME, lk_eta beside every loss), and train's
fingerprint and the fingerprints after it hash that layout. The same settings must not read as changed, or `status`
and `run` would send the user to redo finished training; a setting that really changed still makes train stale.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import write_config

from eaglekit import pipeline, status
from eaglekit.config import load_config
from eaglekit.contract import Stage, no_estimate
from eaglekit.model.sliding_window import draft_window
from eaglekit.rundir import RunDir, file_identity
from eaglekit.stages import train


def params_before_train_ttt(cfg) -> dict:
    """stages/train.params as it was before train.ttt (`git log -S ttt_steps -- src/eaglekit/stages/train.py`, the
    parent of 334bb90): ``cfg.train.model_dump()`` of a flat train section, the loss by its name and lk_eta beside
    every loss (3.0 unless lk_hybrid's was set)."""
    p = train.params(cfg)
    p.pop("window_rule")  # came with sliding_window: auto, after train.ttt
    ttt = dict(p.pop("ttt"))
    loss = dict(ttt.pop("loss"))
    return p | {
        "ttt_steps": ttt.pop("steps"),
        "ttt_decay": ttt.pop("decay"),
        "loss": loss.pop("name"),
        "lk_eta": loss.pop("eta", 3.0),
        **ttt,
    }


def write_output(ctx) -> dict:
    (ctx.dir / "out.txt").write_text(ctx.stage)
    return {"items": 1}


def stages(train_params, **params_of) -> dict[str, Stage]:
    """The pipeline's stages writing one file each; train with its real parameters (``train_params``: as today or
    as before train.ttt) and its real reading of old ledger entries; a stage named in ``params_of`` with those."""
    out = {}
    params_of["train"] = train_params
    for name in pipeline.STAGE_ORDER:
        real = importlib.import_module(f"eaglekit.stages.{name}").STAGE
        out[name] = dataclasses.replace(
            real,
            params=params_of.get(name, lambda cfg: {"n": 0}),
            checks=lambda cfg: [],
            run=write_output,
            estimate=no_estimate,
        )
    return out


def finish_with(train_params, cfg, monkeypatch, **params_of) -> None:
    """Run every stage of ``cfg`` with train's parameters recorded as ``train_params`` made them (an older layout;
    and so any stage named in ``params_of``), then leave today's stages in place, as an upgrade does."""
    old = stages(train_params, **params_of)
    monkeypatch.setattr(pipeline, "stage_of", lambda name: old[name])
    with RunDir(cfg.run_dir).lock:
        for stage in pipeline.stages_for(cfg):
            pipeline.run_stage(cfg, stage)
    today = stages(train.params, **{name: real_params(name) for name in params_of})
    monkeypatch.setattr(pipeline, "stage_of", lambda name: today[name])


def states(cfg) -> dict[str, str]:
    return {row["stage"]: row["state"] for row in status.stage_rows(cfg)}


@pytest.fixture
def config(tmp_path, tiny_target):
    def write(**train_section):
        data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "prompts.jsonl"}}
        return load_config(write_config(tmp_path / "c.yaml", {**data, "train": train_section}))

    return write


LOSSES = [{}, {"loss": {"name": "lk_hybrid", "eta": 2.0}}, {"loss": "jsd", "steps": 3, "step_weights": [1, 1, 1]}]


@pytest.mark.parametrize("ttt", LOSSES, ids=["defaults", "lk_hybrid-eta", "jsd-3-steps"])
def test_a_run_finished_before_train_ttt_is_done_with_the_same_settings(config, monkeypatch, ttt):
    cfg = config(ttt=ttt)
    finish_with(params_before_train_ttt, cfg, monkeypatch)
    recorded = next(ev for ev in RunDir(cfg.run_dir).events() if ev.get("stage") == "train")["params"]
    assert "ttt_steps" in recorded and "ttt" not in recorded  # the ledger holds the old layout
    assert set(states(cfg).values()) == {"done"}
    assert pipeline.changed_parameters(RunDir(cfg.run_dir), "train", cfg) == []
    with RunDir(cfg.run_dir).lock:
        assert all(pipeline.run_stage(cfg, s).get("skipped") for s in ("train", "evaluate", "export"))


def test_a_changed_setting_still_makes_an_old_layout_run_stale(config, monkeypatch):
    cfg = config()
    finish_with(params_before_train_ttt, cfg, monkeypatch)
    changed = config(ttt={"steps": 3})
    rows = {row["stage"]: row for row in status.stage_rows(changed)}
    assert rows["vocab"]["state"] == "done"
    assert [rows[s]["state"] for s in ("train", "evaluate", "export")] == ["stale"] * 3
    # named in today's spelling, and only what changed (not every key the layout moved)
    assert rows["train"]["reason"] == "train.ttt.steps: 7 → 3"


def params_before_auto_window(cfg) -> dict:
    """stages/train.params as it was before sliding_window: auto became the default (the nested train.ttt layout,
    no window_rule, the window as written: unset was null, full attention)."""
    p = train.params(cfg)
    p.pop("window_rule")
    p["draft"]["sliding_window"] = None
    return p


def test_a_drafter_trained_before_the_auto_window_stays_done_where_auto_now_chooses_one(
    tmp_path, tiny_target, monkeypatch
):
    data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "prompts.jsonl"}}
    served_long = {**data, "evaluate": {"context_lengths": [65536]}}  # 32x the rows: auto windows the drafter
    cfg = load_config(write_config(tmp_path / "c.yaml", served_long))
    today = train.params(cfg)
    assert today["draft"]["sliding_window"] == 1024 and "window_rule" in today
    finish_with(params_before_auto_window, cfg, monkeypatch)
    assert set(states(cfg).values()) == {"done"}  # not sent to retrain by the upgrade
    assert pipeline.changed_parameters(RunDir(cfg.run_dir), "train", cfg) == []
    # an explicit window is a setting the old run did not have: that one still makes it stale
    windowed = load_config(
        write_config(tmp_path / "c.yaml", {**served_long, "train": {"draft": {"sliding_window": 512}}})
    )
    rows = {row["stage"]: row for row in status.stage_rows(windowed)}
    assert [rows[s]["state"] for s in ("train", "evaluate", "export")] == ["stale"] * 3


@pytest.mark.parametrize("window", [None, 256], ids=["null", "256"])
def test_a_drafter_trained_before_the_auto_window_with_the_window_the_config_names_stays_done(
    tmp_path, tiny_target, monkeypatch, window
):
    data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "prompts.jsonl"}}
    cfg = load_config(write_config(tmp_path / "c.yaml", {**data, "train": {"draft": {"sliding_window": window}}}))

    def before_auto(cfg) -> dict:  # the window as written, as every release before auto recorded it
        p = train.params(cfg)
        p.pop("window_rule")
        return p

    finish_with(before_auto, cfg, monkeypatch)
    assert set(states(cfg).values()) == {"done"}
    other = load_config(write_config(tmp_path / "c.yaml", {**data, "train": {"draft": {"sliding_window": 128}}}))
    rows = {row["stage"]: row for row in status.stage_rows(other)}
    assert rows["train"]["state"] == "stale" and "sliding_window" in rows["train"]["reason"]


def real_params(name: str):
    return importlib.import_module(f"eaglekit.stages.{name}").STAGE.params


def before_read_identities(name: str):
    """A stage's parameters as eaglekit recorded them before the content identities of its inputs (the parent of
    fc2e510): generate's local target as its folder's file identity, extract's and train's as the identities of
    its config and weight files beside dtype and aux_layers; no identities of tokens or vocabulary."""

    def params(cfg) -> dict:
        p = {k: v for k, v in real_params(name)(cfg).items() if k not in ("tokens", "vocab")}
        folder = Path(cfg.target.model)
        if name == "generate":
            p["model"] = file_identity(folder)
        elif "target" in p:
            weights = [f for f in ("config.json", "model.safetensors") if (folder / f).is_file()]
            p["target"] = {"model": [file_identity(folder / f) for f in weights], "dtype": cfg.target.dtype,
                           "aux_layers": cfg.target.aux_layers}  # fmt: skip
        if name == "train":
            p.pop("window_rule")
        return p

    return params


def test_a_run_finished_before_content_identities_stays_done_until_its_target_changes(
    tmp_path, tiny_target, monkeypatch
):
    target = shutil.copytree(tiny_target, tmp_path / "target")
    data = {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "prompts.jsonl"},
            "generate": {"backend": "local"}, "extract": {"mode": "offline"}, "train": {"draft": {"sliding_window": None}}}  # fmt: skip
    cfg = load_config(write_config(tmp_path / "c.yaml", data))
    old = {name: before_read_identities(name) for name in ("generate", "vocab", "extract")}
    finish_with(before_read_identities("train"), cfg, monkeypatch, **old)
    recorded = next(ev for ev in RunDir(cfg.run_dir).events() if ev.get("stage") == "generate")["params"]
    assert "sha" in recorded["model"]  # the ledger holds the old layout
    assert set(states(cfg).values()) == {"done"}
    assert pipeline.changed_parameters(RunDir(cfg.run_dir), "extract", cfg) == []
    # the same target edited: every stage that reads it is stale, from generate on, and says what changed
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    rows = {row["stage"]: row for row in status.stage_rows(cfg)}
    assert rows["generate"]["state"] == "stale" and "target" in rows["generate"]["reason"]


def test_a_drafter_trained_under_auto_s_first_rule_stays_done_until_that_rule_would_choose_another(
    tmp_path, tiny_target, monkeypatch
):
    data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "prompts.jsonl"}}
    cfg = load_config(write_config(tmp_path / "c.yaml", {**data, "evaluate": {"context_lengths": [65536]}}))

    def rule_one(cfg) -> dict:  # auto as it chose before halving the documents' length (2,048 here, today 1,024)
        p = train.params(cfg)
        p["draft"]["sliding_window"] = draft_window(cfg, rule=1).window
        return p | {"window_rule": 1}

    assert rule_one(cfg)["draft"]["sliding_window"] == 2 * train.params(cfg)["draft"]["sliding_window"]
    finish_with(rule_one, cfg, monkeypatch)
    assert set(states(cfg).values()) == {"done"}
    # served shorter: rule 1 itself would choose another window now, so the drafter is stale
    shorter = load_config(write_config(tmp_path / "c.yaml", {**data, "evaluate": {"context_lengths": [4096]}}))
    assert draft_window(shorter, rule=1).window != rule_one(cfg)["draft"]["sliding_window"]
    assert {row["stage"]: row["state"] for row in status.stage_rows(shorter)}["train"] == "stale"

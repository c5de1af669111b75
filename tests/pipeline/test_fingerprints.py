"""A stage's fingerprint is taken over the values it computes with, resolved (pipeline.Fingerprints, Stage.params):
a config spelled the old way, keys of families the run does not train, or a rule reworded leave a finished run done;
a change to a resolved value — auto's window moved by a rule or by the documents' length — makes it stale, named."""

from __future__ import annotations

import dataclasses
import warnings
from typing import get_args

import pytest
from pydantic import BaseModel
from support.helpers import write_config

from eaglekit import pipeline, status
from eaglekit.config import ConfigDeprecation, load_config
from eaglekit.config.train import LEGACY_ADAM_BETAS
from eaglekit.contract import Stage, no_estimate
from eaglekit.model import sliding_window
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir
from eaglekit.stages import train

# train settings that do not change the drafter: when checkpoints are written, how many ranks split each row, the
# trackers it reports to
NOT_THE_DRAFTERS = {"save_every_minutes", "context_parallel", "report_to"}


def write_output(ctx) -> dict:
    (ctx.dir / "out.txt").write_text(ctx.stage)
    return {"items": 1}


@pytest.fixture
def stages(monkeypatch):
    """Every stage writes one file; train keeps its real parameters, the others a constant (what they read is
    other tests' business), so that only train's fingerprint moves with the config."""
    real = {name: pipeline.stage_of(name) for name in pipeline.STAGE_ORDER}
    fake: dict[str, Stage] = {
        name: dataclasses.replace(
            stage,
            params=stage.params if name == "train" else (lambda run: {"n": 0}),
            checks=lambda cfg: [],
            run=write_output,
            estimate=no_estimate,
        )
        for name, stage in real.items()
    }
    monkeypatch.setattr(pipeline, "stage_of", lambda name: fake[name])


@pytest.fixture
def config(tmp_path, tiny_target):
    def write(name: str = "c.yaml", **sections):
        data = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "prompts.jsonl"}}
        return load_config(write_config(tmp_path / name, {**data, **sections}))

    return write


def finish(cfg) -> None:
    with RunDir(cfg.run_dir).lock:
        for stage in pipeline.stages_for(cfg):
            pipeline.run_stage(cfg, stage)


def rows(cfg) -> dict[str, dict]:
    return {row["stage"]: row for row in status.stage_rows(cfg)}


def states(cfg) -> dict[str, str]:
    return {stage: row["state"] for stage, row in rows(cfg).items()}


def test_a_config_in_the_deprecated_spelling_keeps_a_finished_run_done(stages, config):
    """train's TTT keys moved under train.ttt (a FutureWarning names both spellings): the run a config finished in
    one spelling is done in the other, both ways."""
    today = {"ttt": {"steps": 3, "decay": 0.5, "loss": {"name": "lk_hybrid", "eta": 2.0}}}
    cfg = config("today.yaml", train=today)
    with pytest.warns(ConfigDeprecation):  # one per key, naming both spellings
        old = config("old.yaml", train={"ttt_steps": 3, "ttt_decay": 0.5, "loss": "lk_hybrid", "lk_eta": 2.0})
    finish(old)
    assert set(states(cfg).values()) == {"done"}
    with RunDir(cfg.run_dir).lock:
        assert all(pipeline.run_stage(cfg, s).get("skipped") for s in pipeline.stages_for(cfg))
    assert set(states(old).values()) == {"done"}


def test_keys_of_families_the_run_does_not_train_change_nothing(stages, config):
    """A RUN_DIR/config.yaml names every family's train.draft keys, null where the family has none: those (and any a
    new family adds) are not among train's values, nor is auto's rule, only the window it chose."""
    cfg = config(train={"draft": {"intermediate_size": 256}})
    finish(cfg)
    recorded = next(e for e in RunDir(cfg.run_dir).events() if e.get("stage") == "train")["params"]
    assert recorded["draft"] == {"intermediate_size": 256, "architecture": "llama", "sliding_window": None}
    assert "window_rule" not in recorded
    nulls = {key: None for key in ("block_size", "mask_token_id", "kv_lora_rank", "markov_rank")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nulls are not deprecated spellings: loaded quietly
        spelled_out = config("full.yaml", train={"draft": {"intermediate_size": 256, **nulls}})
    assert set(states(spelled_out).values()) == {"done"}


def test_a_reworded_rule_that_chooses_the_same_window_keeps_the_run_done(stages, config, monkeypatch):
    """Served at 131,072 before prepare has run, auto reads prepare.max_length (6,000): a window of 2,048 (its cap,
    also half the documents' power of two). A rule raising the cap chooses 2,048 still: done. A rule that asks to be
    served farther beyond the documents turns the window off: train and what follows it are stale, named."""
    cfg = config(prepare={"max_length": 6000}, evaluate={"context_lengths": [131072]})
    assert ResolvedRun(cfg).window.window == 2048
    finish(cfg)

    monkeypatch.setattr(sliding_window, "LARGEST_AUTO_WINDOW", 4096)
    assert ResolvedRun(cfg).window.window == 2048 and "at most" not in ResolvedRun(cfg).window.why
    assert set(states(cfg).values()) == {"done"}

    monkeypatch.setattr(sliding_window, "FAR_BEYOND", 64.0)
    assert ResolvedRun(cfg).window.window is None
    found = rows(cfg)
    assert [found[s]["state"] for s in ("generate", "prepare", "vocab")] == ["done"] * 3
    assert [found[s]["state"] for s in ("train", "evaluate", "export")] == ["stale"] * 3
    assert found["train"]["reason"] == "train.draft.sliding_window: 2048 → unset"


def test_a_resolved_value_that_moves_makes_the_drafter_stale(stages, config):
    """prepare.max_length is no train key, yet it moves auto's window (the documents' length, until prepare wrote
    them): train is stale, by its window; the same window written out as a number keeps it done."""
    cfg = config(prepare={"max_length": 6000}, evaluate={"context_lengths": [131072]})
    finish(cfg)
    shorter = config("shorter.yaml", prepare={"max_length": 3000}, evaluate={"context_lengths": [131072]})
    found = rows(shorter)
    assert found["prepare"]["state"] == "done"  # a constant here: only train reads the length, through the window
    assert found["train"]["state"] == "stale"
    assert found["train"]["reason"] == "train.draft.sliding_window: 2048 → 1024"
    explicit = config(
        "explicit.yaml",
        prepare={"max_length": 3000},
        evaluate={"context_lengths": [131072]},
        train={"draft": {"sliding_window": 2048}},
    )
    assert set(states(explicit).values()) == {"done"}


def settings(section: BaseModel, prefix: str = "") -> list[tuple[BaseModel, str, str]]:
    """(model, field, dotted name) of every setting under ``section``, nested sections walked."""
    out = []
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out += settings(value, f"{prefix}{name}.")
        else:
            out.append((section, name, f"{prefix}{name}"))
    return out


def other_value(owner: BaseModel, name: str):
    """Another value for setting ``name`` of ``owner``, of its kind (only train.params reads it: it is not
    validated)."""
    value = getattr(owner, name)
    if name == "sliding_window":
        return 64  # auto (the default) or a number
    if value is None and bool in get_args(type(owner).model_fields[name].annotation):
        return True
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, 1]
    return 3  # unset: set


def test_every_training_setting_but_the_schedule_of_saves_is_in_trains_fingerprint(config):
    """A change that alters what train computes always makes it stale: each train setting changed alone moves the
    fingerprint (the stage's names are its own, so a setting left out of them would go unnoticed)."""
    cfg = config(train={"init_from": None})
    before = train.params(ResolvedRun(cfg))
    missed = []
    for owner, name, dotted in settings(cfg.train):
        if dotted in NOT_THE_DRAFTERS or dotted in ("init_from", "draft.architecture"):
            continue  # init_from: its identity (a folder); the architecture: another family, tested by the registry
        kept = getattr(owner, name)
        object.__setattr__(owner, name, other_value(owner, name))
        try:
            if train.params(ResolvedRun(cfg)) == before:
                missed.append(dotted)
        finally:
            object.__setattr__(owner, name, kept)
    assert not missed, f"train settings not in its fingerprint: {missed}"
    for name in NOT_THE_DRAFTERS:
        kept = getattr(cfg.train, name)
        object.__setattr__(cfg.train, name, other_value(cfg.train, name))
        assert train.params(ResolvedRun(cfg)) == before
        object.__setattr__(cfg.train, name, kept)


def test_adam_betas_at_their_old_value_keep_a_drafter_finished_before_the_key(stages, config):
    """train.adam_betas came after drafters were trained with AdamW (0.9, 0.95): a config that sets those keeps such
    a run done (its train fingerprint is the one it had); any other betas make the drafter stale, named."""
    legacy = config("legacy.yaml", train={"adam_betas": list(LEGACY_ADAM_BETAS)})
    assert "adam_betas" not in train.params(ResolvedRun(legacy))  # the parameters a run recorded before the key
    finish(legacy)
    other = config("other.yaml", train={"adam_betas": [0.9, 0.98]})
    found = rows(other)
    assert found["train"]["state"] == "stale"
    assert found["train"]["reason"] == "train.adam_betas: unset → [0.9, 0.98]"

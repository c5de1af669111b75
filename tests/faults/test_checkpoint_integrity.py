"""Checkpoints are the bytes written: every file of a training checkpoint and of an exported form carries its sha256
(written with the folder); a resumed run falls back from a damaged latest checkpoint to the newest intact one,
naming the file; with none intact it stops with the remedy; evaluate, export and verify refuse a damaged drafter
naming the file, export writes a damaged form again, and `eaglekit status` shows it. Damage is 4 KiB overwritten
in place (the size kept), as a bad disk or a partial copy leaves it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from test_extract import prepared_run
from test_train import QUICK, metrics, train

from eaglekit import atomic, pipeline
from eaglekit.config import parse_config
from eaglekit.drafters.checked import load_checked_drafter
from eaglekit.errors import EaglekitError
from eaglekit.rundir import RunDir
from eaglekit.stages import train as train_stage
from eaglekit.stages import verify
from eaglekit.status import stage_rows
from eaglekit.training import loop

pytestmark = pytest.mark.slow  # trains a drafter

# 6 steps, a checkpoint every 2 (keep 3); the first run stops after step 5, leaving step-2 and step-4 to resume from
SETTINGS = {**QUICK, "max_steps": 6, "save_every": 2, "eval_every": 2, "log_every": 1, "keep_last": 3}


def flip_4k(path: Path) -> None:
    """4 KiB in the middle of the file overwritten with other bytes, the size and the name kept."""
    size = path.stat().st_size
    at = max(0, size // 2 - 2048)
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(4096)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))
    assert path.stat().st_size == size


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_target) -> Path:
    """A run whose training stopped after step 5 (a crash), with checkpoints step-2 and step-4 and best/."""
    base = tmp_path_factory.mktemp("stopped")
    cfg = prepared_run(base, tiny_target, n=32, train=SETTINGS)
    write = loop.Metrics.write

    def write_then_crash(self, row):
        write(self, row)
        if row["kind"] == "train" and row["step"] == 5:
            raise RuntimeError("the machine went away")

    loop.Metrics.write = write_then_crash
    try:
        with pytest.raises(EaglekitError):
            train(cfg)
    finally:
        loop.Metrics.write = write
    ckpts = Path(cfg.run_dir) / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-4"]
    (base / "config.yaml").write_text(cfg.to_yaml())
    return base


def copy_of(stopped: Path, tmp_path: Path, **sections):
    """The stopped run copied whole (the copy's files are hashed once, being new inodes), and its config."""
    shutil.copytree(stopped / "run", tmp_path / "run", symlinks=True)
    data = yaml.safe_load((stopped / "config.yaml").read_text())
    return parse_config({**data, "run_dir": str(tmp_path / "run"), **sections}, base_dir=tmp_path)


def ckpts_of(cfg) -> Path:
    return Path(cfg.run_dir) / "train" / "checkpoints"


def test_every_file_of_a_checkpoint_carries_its_digest(stopped_run):
    for folder in ("step-2", "step-4", "best"):
        manifest = json.loads((stopped_run / "run/train/checkpoints" / folder / atomic.DIGESTS).read_text())
        names = set(manifest["files"])
        assert {"model.safetensors", "config.json"} <= names, names
        assert (folder == "best") == ("training_state.pt" not in names)
        for name, entry in manifest["files"].items():
            assert atomic.sha256_file(stopped_run / "run/train/checkpoints" / folder / name) == entry["sha256"]


@pytest.mark.parametrize("damaged", ["training_state.pt", "model.safetensors", "config.json"])
def test_a_damaged_latest_checkpoint_is_named_and_the_run_resumes_from_the_newest_intact_one(
    stopped_run, tmp_path, capsys, damaged
):
    cfg = copy_of(stopped_run, tmp_path)
    assert (ckpts_of(cfg) / "latest").read_text().strip() == "step-4"
    flip_4k(ckpts_of(cfg) / "step-4" / damaged)
    kept = train_stage.kept(pipeline.make_context(cfg, "train"))  # what a stopped run's message says
    assert kept == f"checkpoint {ckpts_of(cfg) / 'step-2'} (a rerun resumes from it; step-4 is damaged)"
    capsys.readouterr()

    row = train(cfg)

    said = " ".join(capsys.readouterr().err.split())
    assert f"checkpoint step-4 is damaged: {ckpts_of(cfg) / 'step-4' / damaged} changed since it was written" in said
    assert "resuming from step-2, the newest intact checkpoint (step 2; the steps after it are trained again)" in said
    assert "resumed from" in said and "at step 2 of 6" in said
    assert row["counts"]["steps"] == 6
    assert [r["step"] for r in metrics(cfg) if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # 3-4 once, again
    assert not atomic.damage(ckpts_of(cfg) / "step-4"), "step-4 was written again, whole"


def test_with_every_checkpoint_damaged_the_run_stops_naming_each_file_and_the_remedy(stopped_run, tmp_path):
    cfg = copy_of(stopped_run, tmp_path)
    flip_4k(ckpts_of(cfg) / "step-4" / "training_state.pt")
    flip_4k(ckpts_of(cfg) / "step-2" / "model.safetensors")
    with pytest.raises(EaglekitError) as stopped:
        train(cfg)
    message, remedy = stopped.value.message, stopped.value.remedy
    assert f"no intact checkpoint to resume from in {ckpts_of(cfg)}" in message
    assert f"{ckpts_of(cfg) / 'step-4' / 'training_state.pt'} changed since it was written" in message
    assert f"{ckpts_of(cfg) / 'step-2' / 'model.safetensors'} changed since it was written" in message
    assert f"restore {ckpts_of(cfg)} from a copy of the run, or remove it to train from the start" in remedy
    assert "Traceback" not in str(stopped.value)

    shutil.rmtree(ckpts_of(cfg))  # the remedy: the rerun starts over
    assert train(cfg)["counts"]["steps"] == 6


def test_status_shows_a_damaged_checkpoint(stopped_run, tmp_path):
    cfg = copy_of(stopped_run, tmp_path)
    assert not any(r["damaged"] for r in stage_rows(cfg))
    flip_4k(ckpts_of(cfg) / "step-4" / "training_state.pt")
    row = next(r for r in stage_rows(cfg) if r["stage"] == "train")
    assert len(row["damaged"]) == 1
    assert row["damaged"][0].startswith(f"{ckpts_of(cfg) / 'step-4' / 'training_state.pt'} changed since it was")


def test_a_damaged_best_checkpoint_is_refused_by_evaluate_and_export_naming_the_file(stopped_run, tmp_path):
    cfg = copy_of(stopped_run, tmp_path)
    best = ckpts_of(cfg) / "best"
    load_checked_drafter(cfg)  # intact: read
    flip_4k(best / "model.safetensors")
    with pytest.raises(EaglekitError) as refused:
        load_checked_drafter(cfg)  # what evaluate and export read
    assert f"drafter {best} is damaged: {best / 'model.safetensors'} changed since it was written" in (
        refused.value.message
    )
    assert f"set evaluate.checkpoint: {ckpts_of(cfg) / 'step-4'} (the newest intact checkpoint)" in (
        refused.value.remedy
    )
    with RunDir(cfg.run_dir).lock, pytest.raises(EaglekitError) as export:
        pipeline.run_stage(cfg, "export", skip_preflight=True)
    assert f"{best / 'model.safetensors'} changed since it was written" in export.value.message


def test_a_damaged_exported_form_is_refused_by_evaluate_and_verify_and_export_writes_it_again(
    stopped_run, tmp_path, capsys
):
    cfg = copy_of(stopped_run, tmp_path, verify={"engine": "vllm", "formats": ["eagle3"]})
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    form = Path(cfg.run_dir) / "export" / "eagle3"
    assert json.loads((form / atomic.DIGESTS).read_text())["files"].keys() >= {"model.safetensors", "config.json"}
    flip_4k(form / "model.safetensors")
    named = f"{form / 'model.safetensors'} changed since it was written"

    evaluating = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"checkpoint": str(form)})})
    with pytest.raises(EaglekitError) as refused:
        load_checked_drafter(evaluating)
    assert named in refused.value.message

    ctx = pipeline.make_context(cfg, "verify")
    check = verify.exported_forms(ctx)
    assert check.status == "fail" and named in check.detail, check
    assert "rerun `eaglekit export CONFIG`" in check.remedy
    with pytest.raises(EaglekitError) as served:
        verify.refuse_damaged_drafter(form, "exported drafter")
    assert f"exported drafter {form} is damaged: {named}" in served.value.message

    assert any(named in d for r in stage_rows(cfg) if r["stage"] == "export" for d in r["damaged"])
    capsys.readouterr()
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert f"export: done, but {named}" in " ".join(capsys.readouterr().err.split())
    assert not atomic.damage(form)


def test_an_exported_config_edited_by_hand_is_served_as_it_is_and_not_rewritten(stopped_run, tmp_path, capsys):
    """A hand edit of an exported config.json (trying another setting) is no damage: verify serves it, saying so,
    and export leaves it."""
    cfg = copy_of(stopped_run, tmp_path, verify={"engine": "vllm", "formats": ["eagle3"]})
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    form = Path(cfg.run_dir) / "export" / "eagle3"
    raw = json.loads((form / "config.json").read_text())
    (form / "config.json").write_text(json.dumps({**raw, "rope_theta": 1.0}, indent=2))
    capsys.readouterr()
    assert verify.exported_forms(pipeline.make_context(cfg, "verify")).status == "ok"
    assert f"exported drafter {form}: edited since it was written: {form / 'config.json'}" in " ".join(
        capsys.readouterr().err.split()
    )
    with RunDir(cfg.run_dir).lock:
        assert pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])["skipped"]
    assert json.loads((form / "config.json").read_text())["rope_theta"] == 1.0


def test_a_finetune_from_a_damaged_eaglekit_checkpoint_is_refused(stopped_run, tmp_path):
    from eaglekit.hub import drafter_folder

    best = Path(shutil.copytree(stopped_run / "run/train/checkpoints/best", tmp_path / "best"))
    assert drafter_folder(str(best)) == best
    flip_4k(best / "model.safetensors")
    with pytest.raises(EaglekitError) as refused:
        drafter_folder(str(best))
    assert f"train.init_from {best} is damaged: {best / 'model.safetensors'} changed since" in refused.value.message


def test_a_copied_checkpoint_is_hashed_once_and_then_trusted_by_its_key(tmp_path):
    with atomic.atomic_dir(tmp_path / "a", digests=True) as d:
        (d / "w.bin").write_bytes(os.urandom(10_000))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert not atomic.damage(tmp_path / "b")
    recorded = json.loads((tmp_path / "b" / atomic.DIGESTS).read_text())["files"]["w.bin"]["key"]
    assert recorded == atomic.file_key(tmp_path / "b" / "w.bin"), "the copy's key is recorded: no second read"
    (tmp_path / "b" / "w.bin").unlink()
    assert [str(d) for d in atomic.damage(tmp_path / "b")] == [
        f"{tmp_path / 'b' / 'w.bin'} is missing (it was written with this folder)"
    ]

"""A full disk is named at every writer of a stage, never reported as eaglekit's own bug: a checkpoint's weights
(safetensors' writer) and its training state (torch's), train's metrics.jsonl, the ledger between stages,
evaluate's report and export's forms. The message names the file, the free bytes against what the stage needs and
the point a rerun resumes from; nothing half-written stays; once space is freed the same command resumes.

Each case fills a real tmpfs (mounted as root, as CI runs) from inside the stage, leaving a chosen number of bytes,
so that the write in question is the one that meets the full disk."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest
from support.helpers import mounted_tmpfs
from test_extract import prepared_run
from test_train import QUICK

from eaglekit import atomic, pipeline
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow  # trains a drafter

# 4 steps, a checkpoint every 2; held-out evaluation only at the end (so the first write of a checkpoint is step-2's)
SETTINGS = {**QUICK, "max_steps": 4, "save_every": 2, "eval_every": 100, "log_every": 1, "keep_last": 2}
FILLER = "filler.bin"


@pytest.fixture
def volume(tmp_path):
    with mounted_tmpfs(tmp_path / "vol", "24m") as mnt:
        yield mnt


def fill(volume: Path, leave: int) -> None:
    """Fill the volume for real, then give back ``leave`` bytes (rounded to its pages)."""
    fd = os.open(volume / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 20, 1 << 12):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    size = (volume / FILLER).stat().st_size
    os.truncate(volume / FILLER, max(0, size - leave))


def free_space(volume: Path) -> None:
    (volume / FILLER).unlink()


@pytest.fixture
def filled_during(monkeypatch, volume):
    """``filled_during(stage, leave)``: the volume is filled (but ``leave`` bytes) as ``stage`` starts its work."""

    def arm(stage: str, leave: int) -> None:
        declared = pipeline.stage_of(stage)
        work = declared.run

        def filled_then_run(ctx):
            fill(volume, leave)
            return work(ctx)

        monkeypatch.setattr(declared, "run", filled_then_run)

    return arm


def run_on(volume: Path, tiny_target: Path, **sections) -> Path:
    """A prepared run (prepare and vocab done) on the volume; its config beside it."""
    cfg = prepared_run(volume, tiny_target, n=32, train=SETTINGS, **sections)
    (volume / "config.yaml").write_text(cfg.to_yaml())
    return volume / "config.yaml"


def said(err: str) -> str:
    return " ".join(err.split())


def no_leftovers(folder: Path) -> list[str]:
    """Temp files and folders of atomic writes that a failed write would have left."""
    return [str(p) for p in folder.rglob(".*") if p.name.endswith((".tmp", ".old"))]


def assert_named(r, stage: str, path: Path, kept: str) -> None:
    text = said(r.err)
    assert r.code == 1 and "Traceback" not in r.err and "unexpected error" not in text, r.err
    assert f"{stage}: disk full writing {path} (No space left on device); {kept}" in text, r.err
    assert "free there; the plan needs about" in text, r.err
    assert "free space on that filesystem (or point run_dir at a larger one), then rerun the same command" in text


@pytest.fixture
def full_at_checkpoint(monkeypatch, volume):
    """``full_at_checkpoint(step, before_weights)``: the volume fills up as checkpoint ``step-N`` is written, before
    its weights (safetensors' writer) or after them, before its training state (torch.save's writer)."""
    from eaglekit.training.step_checkpoints import Checkpoints

    def arm(step: int, before_weights: bool) -> None:
        save_drafter = Checkpoints.save_drafter

        def filling(self, drafter_cfg, msd, out):
            mine = out.name.startswith(f".step-{step}.")
            if mine and before_weights:
                fill(volume, 0)
            save_drafter(self, drafter_cfg, msd, out)
            if mine and not before_weights:
                fill(volume, 0)

        monkeypatch.setattr(Checkpoints, "save_drafter", filling)

    return arm


def test_a_full_disk_writing_a_checkpoints_weights_is_named_and_nothing_half_written_stays(
    volume, tiny_target, full_at_checkpoint, cli, monkeypatch
):
    config = run_on(volume, tiny_target)
    ckpts = volume / "run" / "train" / "checkpoints"
    full_at_checkpoint(2, before_weights=True)
    r = cli("train", config, "--skip-preflight")
    assert_named(r, "train", ckpts / "step-2", "no checkpoint yet (a rerun starts over)")
    assert not (ckpts / "step-2").exists() and not no_leftovers(volume / "run")
    end = [json.loads(line) for line in (volume / "run" / "ledger.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["state"] == "failed" and end["reason"] == "disk full"

    monkeypatch.undo()
    free_space(volume)
    r = cli("train", config, "--skip-preflight")
    assert r.code == 0, r.err
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-4"]


def test_a_full_disk_writing_a_checkpoints_training_state_is_named_with_the_checkpoint_a_rerun_resumes_from(
    volume, tiny_target, full_at_checkpoint, cli, monkeypatch
):
    """The reported bug: torch.save's "[enforce fail at inline_container.cc:672] . unexpected pos" on a full disk
    read as eaglekit's own unexpected error."""
    config = run_on(volume, tiny_target)
    ckpts = volume / "run" / "train" / "checkpoints"
    full_at_checkpoint(4, before_weights=False)
    r = cli("train", config, "--skip-preflight")
    assert_named(
        r, "train", ckpts / "step-4" / "training_state.pt", f"checkpoint {ckpts / 'step-2'} (a rerun resumes from it)"
    )
    assert (ckpts / "latest").read_text().strip() == "step-2" and not (ckpts / "step-4").exists()
    assert not atomic.damage(ckpts / "step-2") and not no_leftovers(volume / "run")

    monkeypatch.undo()
    free_space(volume)
    r = cli("train", config, "--skip-preflight")
    assert r.code == 0 and f"resumed from {ckpts / 'step-2'} at step 2" in said(r.err), r.err


def test_a_full_disk_writing_metrics_is_named_and_leaves_no_torn_line(volume, tiny_target, filled_during, cli):
    config = run_on(volume, tiny_target)
    metrics = volume / "run" / "train" / "metrics.jsonl"
    filled_during("train", 0)  # its first write is the held-out evaluation at step 0, into metrics.jsonl
    r = cli("train", config, "--skip-preflight")
    assert_named(r, "train", metrics, "no checkpoint yet (a rerun starts over)")
    assert not metrics.exists() or metrics.read_bytes() == b"", "no torn line"


def page_aligned(path: Path) -> None:
    """Blank lines (which every reader skips) up to the filesystem's next page: the next append needs a new page,
    so a full tmpfs refuses it (a partly filled last page would still take a short line)."""
    with open(path, "a") as f:
        f.write("\n" * (-path.stat().st_size % os.statvfs(path).f_bsize))


def test_a_full_disk_writing_the_ledger_between_stages_is_named(volume, tiny_target, cli, monkeypatch):
    config = run_on(volume, tiny_target)
    append = RunDir.append_event

    ledger = volume / "run" / "ledger.jsonl"
    before = []

    def fill_then_append(self, event):
        if event.get("event") == "start":
            fill(volume, 0)
            page_aligned(ledger)
            before.append(ledger.read_bytes())
        return append(self, event)

    monkeypatch.setattr(RunDir, "append_event", fill_then_append)
    r = cli("train", config, "--skip-preflight")
    text = said(r.err)
    assert r.code == 1 and "Traceback" not in r.err and "unexpected" not in text, r.err
    assert f"disk full writing {ledger} (No space left on device)" in text and "free there" in text, r.err
    assert "then rerun the same command to resume" in text
    assert ledger.read_bytes() == before[0], "no torn line"


def test_a_full_disk_writing_evaluate_and_export_outputs_is_named(volume, tiny_target, filled_during, cli, monkeypatch):
    config = run_on(
        volume,
        tiny_target,
        evaluate={"num_samples": 2, "max_new_tokens": 12, "num_speculative_tokens": [1], "temperatures": [0.0]},
        export={"formats": ["eagle3"]},
    )
    assert cli("train", config, "--skip-preflight").code == 0

    filled_during("evaluate", 0)
    r = cli("evaluate", config, "--skip-preflight")
    text = said(r.err)
    evaluate = volume / "run" / "evaluate"
    assert r.code == 1 and "Traceback" not in r.err and "unexpected error" not in text, r.err
    assert f"evaluate: disk full writing {evaluate}/" in text and "free there" in text, r.err
    assert not no_leftovers(volume / "run") and not (evaluate / "report.json").exists()
    monkeypatch.undo()
    free_space(volume)
    r = cli("evaluate", config, "--skip-preflight")
    assert r.code == 0, r.err

    filled_during("export", 0)
    r = cli("export", config, "--skip-preflight")
    form = volume / "run" / "export" / "eagle3"
    assert_named(r, "export", form, "nothing partial of export is kept")
    assert not form.exists() and not no_leftovers(volume / "run")
    monkeypatch.undo()
    free_space(volume)
    assert cli("export", config, "--skip-preflight").code == 0 and not atomic.damage(form)


def test_torch_and_safetensors_writers_failures_read_as_the_errno_they_stand_for(tmp_path, monkeypatch):
    """Their exceptions, as raised on a full disk (read on tmpfs), become the OSError naming the file."""
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 0)  # the disk is full
    torch_failed = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    torch_failed.__context__ = RuntimeError("basic_ios::clear: iostream error")
    with pytest.raises(OSError) as named, atomic.atomic_dir(tmp_path / "ck") as tmp:
        (tmp / "training_state.pt").write_bytes(b"partial")
        raise torch_failed
    assert named.value.errno == errno.ENOSPC and named.value.filename == str(tmp_path / "ck")
    with (
        pytest.raises(OSError) as named,
        atomic.atomic_dir(tmp_path / "ck") as tmp,
        atomic.naming_file(tmp / "training_state.pt"),  # as a checkpoint wraps torch.save
    ):
        raise torch_failed
    assert named.value.errno == errno.ENOSPC and named.value.filename == str(tmp_path / "ck" / "training_state.pt")
    assert not list(tmp_path.iterdir()), "nothing half-written stays"
    rust = RuntimeError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    assert atomic.wrapped_errno(rust, tmp_path) == errno.EDQUOT
    assert atomic.wrapped_errno(RuntimeError("a shape mismatch"), tmp_path) is None


def test_a_quota_exceeded_between_stages_is_named_like_a_full_disk(tmp_path):
    from eaglekit import failures

    ledger = tmp_path / "ledger.jsonl"
    named = failures.outside_stage(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(ledger)))
    assert named is not None and named.message.startswith(f"disk quota exceeded writing {ledger} (")
    assert "free there" in named.message and "a rerun resumes it" in named.message
    assert (
        named.remedy
        == "free space within your quota (or point run_dir elsewhere), then rerun the same command to resume"
    )
    assert failures.outside_stage(ValueError("not a disk fault")) is None

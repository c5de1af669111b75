"""Run directory mechanics: the one-process lock, ledger states, skip-if-done, staleness, incomplete runs."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys

import pytest
from support.helpers import subprocess_env, write_config

from eaglekit import pipeline, status
from eaglekit.config import load_config
from eaglekit.contract import Stage
from eaglekit.errors import EaglekitError
from eaglekit.rundir import RunDir

BASE = {"run_dir": "run", "target": {"model": "model"}, "data": {"prompts": "prompts.jsonl"}}


def hold_lock_in_subprocess(run_dir):
    code = (
        "import sys, time; from eaglekit.rundir import RunDir; "
        f"RunDir({str(run_dir)!r}).lock.acquire(command='eaglekit train held-by-test'); "
        "print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_fails_at_once_naming_the_holder(tmp_path, cli):
    cfg_path = write_config(tmp_path / "c.yaml", BASE)
    holder = hold_lock_in_subprocess(tmp_path / "run")
    try:
        r = cli("prepare", cfg_path)
        assert r.code == 1
        assert f"pid {holder.pid}" in r.err and "eaglekit train held-by-test" in r.err
        assert RunDir(tmp_path / "run").lock.is_held_elsewhere()
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the flock of the killed holder: the lock is free again without cleanup.
    assert not RunDir(tmp_path / "run").lock.is_held_elsewhere()
    RunDir(tmp_path / "run").lock.acquire().release()


def fake_stage(name, upstream, calls, fail=False):
    """A stage that writes one file; ``fail`` is an exception to raise (True: an EaglekitError), or a callable
    of the config saying whether to fail."""

    def run(ctx):
        calls.append(name)
        failure = fail(ctx.cfg) if callable(fail) else fail
        if failure:
            (ctx.dir / "partial.txt").write_text(name)  # what a failed attempt leaves behind
            raise failure if isinstance(failure, BaseException) else EaglekitError(f"{name} broke", "fix it")
        (ctx.dir / "out.txt").write_text(name)
        return {"items": 3}

    real = importlib.import_module(f"eaglekit.stages.{name}").STAGE
    return Stage(
        name=name,
        upstream=upstream,
        reads="",
        writes=f"{name}/out.txt",
        params=lambda run: {"n": run.cfg.prepare.max_length if name == "prepare" else 0},
        checks=lambda cfg: [],
        run=run,
        # the real stage's skip rule and reading of its counts
        runs_for=real.runs_for,
        data_flags=real.data_flags,
    )


@pytest.fixture
def fake_pipeline(monkeypatch):
    calls: list[str] = []
    mods = {
        "generate": fake_stage("generate", None, calls),
        "prepare": fake_stage("prepare", "generate", calls),
        "vocab": fake_stage("vocab", "prepare", calls),
        "extract": fake_stage("extract", "vocab", calls),
        "train": fake_stage("train", "extract", calls),
        "evaluate": fake_stage("evaluate", "train", calls),
        "export": fake_stage("export", "evaluate", calls),
        "verify": fake_stage("verify", "export", calls),
    }
    monkeypatch.setattr(pipeline, "stage_of", lambda name: mods[name])
    return mods, calls


def states(cfg):
    return {r["stage"]: r["state"] for r in status.stage_rows(cfg)}


def test_ledger_states_skip_and_staleness(tmp_path, fake_pipeline):
    mods, calls = fake_pipeline
    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    run = RunDir(cfg.run_dir)
    assert set(states(cfg).values()) == {"pending"}
    with run.lock:
        for s in ("generate", "prepare", "vocab"):
            pipeline.run_stage(cfg, s)
    assert states(cfg)["vocab"] == "done" and states(cfg)["train"] == "pending"
    assert calls == ["generate", "prepare", "vocab"]
    with run.lock:
        assert pipeline.run_stage(cfg, "prepare").get("skipped") is True
    assert calls == ["generate", "prepare", "vocab"]

    # A changed parameter makes that stage and everything after it stale, not the stages before it.
    cfg2 = load_config(write_config(tmp_path / "c.yaml", {**BASE, "prepare": {"max_length": 99}}))
    st = states(cfg2)
    assert st["generate"] == "done" and st["prepare"] == "stale" and st["vocab"] == "stale"
    # And a downstream stage refuses to start on stale inputs.
    with run.lock, pytest.raises(EaglekitError, match="pre-flight failed"):
        pipeline.run_stage(cfg2, "vocab")

    # --force never reruns a stage done with the same fingerprint; removing its folder undoes it.
    with run.lock:
        assert pipeline.run_stage(cfg, "generate", force=True).get("skipped") is True
    assert calls.count("generate") == 1
    import shutil

    shutil.rmtree(tmp_path / "run" / "generate")
    assert states(cfg)["generate"] == "pending"
    with run.lock:
        pipeline.run_stage(cfg, "generate")
    assert calls.count("generate") == 2


def test_failed_stage_is_recorded_and_reported(tmp_path, fake_pipeline):
    mods, calls = fake_pipeline
    mods["generate"] = fake_stage("generate", None, calls, fail=True)
    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    with RunDir(cfg.run_dir).lock, pytest.raises(EaglekitError):
        pipeline.run_stage(cfg, "generate")
    row = status.stage_rows(cfg)[0]
    assert row["state"] == "failed" and "generate broke" in row["error"]


def test_foreign_data_in_output_folder_is_refused_unless_forced(tmp_path, fake_pipeline):
    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    (tmp_path / "run" / "generate").mkdir(parents=True)
    (tmp_path / "run" / "generate" / "responses.jsonl").write_text("{}\n")
    with RunDir(cfg.run_dir).lock:
        with pytest.raises(EaglekitError, match="no eaglekit stage run wrote"):
            pipeline.run_stage(cfg, "generate")
        pipeline.run_stage(cfg, "generate", force=True)
    assert not (tmp_path / "run" / "generate" / "responses.jsonl").exists()


def test_killed_stage_shows_incomplete_and_lock_is_free(tmp_path, fake_pipeline):
    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    code = (
        f"import time; from eaglekit.rundir import RunDir; r = RunDir({cfg.run_dir!r}); r.lock.acquire(); "
        "r.append_event({'stage': 'generate', 'event': 'start', 'fingerprint': 'x'}); print('started', flush=True); "
        "time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline().strip() == "started"
    assert states(cfg)["generate"] == "running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rows = status.stage_rows(cfg)
    assert rows[0]["state"] == "incomplete"
    assert status.next_steps(cfg, rows, "c.yaml") == [
        "generate was stopped mid-run; to resume it:",
        "  eaglekit run c.yaml",
    ]


def test_ledger_survives_a_torn_last_line(tmp_path):
    run = RunDir(tmp_path)
    run.append_event({"stage": "generate", "event": "start", "fingerprint": "f"})
    with open(run.ledger_path, "a") as f:
        f.write('{"stage": "generate", "event": "en')
    assert run.last_events()["generate"]["start"]["fingerprint"] == "f"
    assert json.loads(run.ledger_path.read_text().splitlines()[0])["event"] == "start"

"""Other processes in the run directory: a plain Python process holding generate/responses.jsonl open for append
(the aborted run that never took eaglekit's lock), one that only works there, and the lock holder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.helpers import subprocess_env, write_config

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.preflight import processes
from eaglekit.rundir import RunDir


def start(code: str, cwd=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "\nprint('ready', flush=True)\nimport time; time.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=subprocess_env(),
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def procs():
    started = []
    yield lambda *a, **k: started.append(start(*a, **k)) or started[-1]
    for p in started:
        p.kill()
        p.wait()


def config(tmp_path, tiny_target):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    return load_config(
        write_config(
            tmp_path / "c.yaml",
            {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "p.jsonl"}},
        )
    )


def test_a_process_appending_to_the_responses_fails_the_preflight_naming_it(tmp_path, tiny_target, procs, cli):
    cfg = config(tmp_path, tiny_target)
    responses = tmp_path / "run" / "generate" / "responses.jsonl"
    responses.parent.mkdir(parents=True)
    writer = procs(f"f = open({str(responses)!r}, 'a')")
    result = processes.other_processes(pipeline.make_context(cfg, "generate"))
    assert result.status == "fail"
    assert f"pid {writer.pid}" in result.detail and "writes generate/responses.jsonl" in result.detail
    assert "started 20" in result.detail and "kill" in result.remedy

    # the stage refuses to start: nothing generated, the file untouched
    r = cli("generate", tmp_path / "c.yaml")
    assert r.code == 1 and f"pid {writer.pid}" in r.err
    assert responses.read_text() == ""


def test_a_process_that_only_works_in_the_run_directory_is_a_warning(tmp_path, tiny_target, procs):
    cfg = config(tmp_path, tiny_target)
    (tmp_path / "run").mkdir()
    reader = procs("pass", cwd=tmp_path / "run")
    result = processes.other_processes(pipeline.make_context(cfg, "generate"))
    assert result.status == "warn" and f"pid {reader.pid}" in result.detail and "works in it" in result.detail


def test_no_other_process_and_the_lock_holder_raise_no_alarm(tmp_path, tiny_target, procs):
    cfg = config(tmp_path, tiny_target)
    (tmp_path / "run").mkdir()
    ctx = pipeline.make_context(cfg, "generate")
    assert processes.other_processes(ctx).status == "ok"
    # the holder of the run lock has .lock open for writing; the lock check reports it, this one does not
    procs(f"from eaglekit.rundir import RunDir; RunDir({str(tmp_path / 'run')!r}).lock.acquire(command='held')")
    assert RunDir(tmp_path / "run").lock.is_held_elsewhere()
    assert processes.other_processes(ctx).status == "ok"

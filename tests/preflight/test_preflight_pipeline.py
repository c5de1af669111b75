"""`eaglekit preflight` as the go/no-go check before a first run: a fresh healthy config exits 0, checks that need
outputs still to be made say which stage makes them, real problems still exit 1, and a stage run for real still
refuses a missing upstream."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from support.helpers import subprocess_env

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.demo import demo_config
from eaglekit.tiny import write_prompts


def fresh_demo(tmp_path, tiny_target, **changes):
    run = tmp_path / "demo"
    run.mkdir()
    write_prompts(run / "prompts.jsonl", n=40, seed=1234)
    data = demo_config(tiny_target)
    data["preflight"] = {"disk_probe_mb": 4}
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run / "config.yaml"


def test_a_fresh_healthy_config_passes_and_says_what_later_stages_will_get(tmp_path, tiny_target, cli):
    r = cli("preflight", fresh_demo(tmp_path, tiny_target), "--json")
    doc = json.loads(r.out)
    assert r.code == 0 and doc["ok"], [c for s in doc["stages"].values() for c in s if c["status"] == "fail"]
    verify = ["verify"] if "verify" in doc["stages"] else []  # the demo verifies in vLLM when it is installed
    assert list(doc["stages"]) == ["generate", "prepare", "vocab", "train", "evaluate", "export", *verify]
    upstream = {s: next(c for c in checks if c["name"] == "upstream") for s, checks in doc["stages"].items()}
    assert upstream["generate"]["detail"] == "first stage"
    assert upstream["prepare"] == {**upstream["prepare"], "status": "skip", "detail": "will be produced by `generate`"}
    assert upstream["train"]["detail"] == "will be produced by `vocab`"
    evaluate = {c["name"]: c for c in doc["stages"]["evaluate"]}
    assert evaluate["drafter checkpoint"]["detail"] == "will be produced by `train`"
    assert evaluate["evaluation prompts"]["detail"] == "will be produced by `generate`"
    for name in ("target weights", "target dense tensors", "software", "devices", "other processes", "filesystem"):
        assert evaluate.get(name, {"status": "ok"})["status"] in ("ok", "skip")
    assert {c["name"] for c in doc["stages"]["train"]} >= {"write rate", "disk space", "GPUs", "target weights"}


def test_a_stage_run_for_real_still_fails_on_a_missing_upstream(tmp_path, tiny_target, cli):
    config = fresh_demo(tmp_path, tiny_target)
    strict = cli("preflight", config, "--stage", "prepare", "--json")
    assert strict.code == 1
    [bad] = [c for c in json.loads(strict.out)["stages"]["prepare"] if c["status"] == "fail"]
    assert bad["name"] == "upstream" and "has not finished" in bad["detail"]
    run = cli("prepare", config)
    assert run.code == 1 and "stage 'generate' has not finished" in run.err


def test_a_finished_upstream_is_checked_and_the_next_one_is_pending(tmp_path, tiny_target):
    cfg = load_config(fresh_demo(tmp_path, tiny_target))
    ctx = pipeline.make_context(cfg, "generate")
    ctx.run.write_marker("generate", ctx.fingerprint)  # a finished stage's folder says whose outputs it holds
    ctx.run.append_event({"stage": "generate", "event": "start", "fingerprint": ctx.fingerprint})
    ctx.run.append_event({"stage": "generate", "event": "end", "state": "done", "fingerprint": ctx.fingerprint})
    report = pipeline.preflight_pipeline(cfg)
    up = {s: next(r for r in results if r.name == "upstream") for s, results in report.items()}
    assert up["prepare"].status == "ok" and up["vocab"].detail == "will be produced by `prepare`"


def test_a_real_problem_fails_the_whole_pipeline_preflight(tmp_path, tiny_target, cli):
    r = cli("preflight", fresh_demo(tmp_path, tiny_target, vocab={"draft_vocab_size": 100_000}), "--json")
    assert r.code == 1
    bad = [(s, c["name"]) for s, checks in json.loads(r.out)["stages"].items() for c in checks if c["status"] == "fail"]
    assert bad == [("vocab", "draft vocab size")]


def test_the_preflight_checks_do_not_import_the_pipeline():
    code = (
        "import sys; from eaglekit.preflight import run_directory, dataset, disk, environment, files, gpus, processes; "
        "print('eaglekit.pipeline' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), check=True)
    assert out.stdout.strip() == "False"

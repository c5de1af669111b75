"""The local backend on the tiny target: generation, the reasoning split, resume after kill -9, the gate."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import subprocess_env, write_config

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.chat import load_tokenizer, render_sample, use_generated_tokens
from eaglekit.data.prompts import load_prompts
from eaglekit.data.responses import read_responses
from eaglekit.errors import EaglekitError
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow  # builds, trains or serves models


def config_dict(tmp_path: Path, target: Path, n: int, **generate) -> dict:
    from eaglekit.tiny import write_prompts

    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(tmp_path / "prompts.jsonl", n, seed=3)
    return {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target), "dtype": "float32"},
        "data": {"prompts": str(prompts)},
        "generate": {"backend": "local", "max_tokens": 200, "batch_size": 4, **generate},
    }


def run(cfg, **kw) -> dict:
    with RunDir(cfg.run_dir).lock:
        return pipeline.run_stage(cfg, "generate", **kw)


def records(cfg) -> list[dict]:
    return list(read_responses(Path(cfg.run_dir) / "generate" / "responses.jsonl"))


def test_local_backend_generates_and_splits_the_reasoning(tmp_path, tiny_target):
    cfg = parse_config(config_dict(tmp_path, tiny_target, n=6), base_dir=tmp_path)
    out = run(cfg)
    rows = records(cfg)
    assert sorted(r["id"] for r in rows) == sorted(p.id for p in load_prompts(cfg.data.prompts).records)
    tokenizer = load_tokenizer(str(tiny_target))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in rows:
        assert r["reasoning_source"] == "inline_think" and r["finish_reason"] == "stop"
        assert r["model"] == str(tiny_target) and r["server"] is None
        ids = r["completion_token_ids"]
        assert ids[-1] == end_of_turn and r["completion_tokens"] == len(ids)
        # the record is exactly what the model said: its tokens decode to the tiny template's reply layout
        assert tokenizer.decode(ids) == f"<think>\n{r['reasoning']}\n</think>\n\n{r['content']}<|im_end|>"
        # and rendered for training (as prepare does), the reply's tokens are exactly the ones the model generated
        sample = render_sample(tokenizer, r["messages"], r["reasoning"], r["content"])
        train_ids, train_mask, _ = use_generated_tokens(tokenizer, sample.input_ids, sample.loss_mask, ids)
        assert [t for t, m in zip(train_ids, train_mask, strict=False) if m] == ids
    end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
    assert end["gate"]["passed"] and end["gate"]["samples"] == 6  # required: the tiny template has think tags
    assert out["counts"]["empty_reasoning"] == 0 and end["rates"]["output_tok_per_s"] > 0


def test_sampling_is_seeded(tmp_path, tiny_target):
    outs = []
    for name in ("a", "b"):
        data = config_dict(
            tmp_path / name, tiny_target, n=3, temperature=1.0, seed=11, max_tokens=24, reasoning="optional"
        )
        cfg = parse_config(data, base_dir=tmp_path / name)
        run(cfg, skip_preflight=True)
        outs.append({r["id"]: r["completion_token_ids"] for r in records(cfg)})
    assert outs[0] == outs[1]


def test_gate_stops_when_replies_end_before_their_reasoning_closes(tmp_path, tiny_target):
    cfg = parse_config(config_dict(tmp_path, tiny_target, n=8, max_tokens=3, gate_samples=4), base_dir=tmp_path)
    with pytest.raises(EaglekitError, match=r"4 of the first 4 .*max_tokens"):
        run(cfg, skip_preflight=True)
    assert records(cfg) == []


def test_resume_after_kill_9_gives_every_id_once(tmp_path, tiny_target):
    data = config_dict(tmp_path, tiny_target, n=10, batch_size=2, max_tokens=32, reasoning="optional")
    config = write_config(tmp_path / "config.yaml", data)
    responses = tmp_path / "run" / "generate" / "responses.jsonl"
    env = {**subprocess_env(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eaglekit.cli", "generate", str(config)]

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (responses.exists() and responses.read_bytes().count(b"\n") >= 4):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no responses within 180s"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done_before = responses.read_bytes().count(b"\n")
    assert done_before < 10

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cfg = parse_config(data, base_dir=tmp_path)
    ids = [r["id"] for r in records(cfg)]
    assert sorted(ids) == sorted(p.id for p in load_prompts(cfg.data.prompts).records)  # all, each once
    assert all(json.loads(line) for line in responses.read_bytes().splitlines())
    assert f"{done_before} already done" in done.stderr

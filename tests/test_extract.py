"""Offline extraction: shards + index that match the live target, resume after a kill, disk estimate and checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eaglekit.config import RunConfig, parse_config
from eaglekit.data import shards as sh
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.model.target import TargetFeatures, load_target
from eaglekit.pipeline import make_context, run_preflight, run_stage
from eaglekit.rundir import RunDir
from eaglekit.stages import extract
from eaglekit.tiny.corpus import sample_tasks




def prepared_run(tmp_path: Path, target: Path, n: int = 48, seed: int = 1, **sections) -> RunConfig:
    """A run directory whose prepare and vocab stages are done, on the tiny target's corpus rendered with its
    template (tasks the target was trained on the like of, so its features are meaningful)."""
    gen = tmp_path / "run" / "generate"
    gen.mkdir(parents=True)
    rows = [{"id": f"t{seed}-{i}", "messages": [{"role": "user", "content": t.prompt}], "reasoning": t.reasoning,
             "content": t.answer, "finish_reason": "stop", "prompt_tokens": 0, "completion_tokens": 0,
             "reasoning_source": "reasoning", "model": "tiny", "server": None}
            for i, t in enumerate(sample_tasks(n, seed, split="train"))]
    (gen / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "unused.jsonl", "eval_fraction": 0.1},
            "vocab": {"draft_vocab_size": 200}, **sections}
    cfg = parse_config(data, base_dir=tmp_path)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "prepare", skip_preflight=True)
        run_stage(cfg, "vocab", skip_preflight=True)
    return cfg


def offline(tmp_path, tiny_target):
    """A prepared run in offline mode whose features make four shards."""
    cfg = prepared_run(tmp_path, tiny_target, extract={"mode": "offline"})
    cfg.extract.shard_tokens = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors").total_tokens // 4 + 1
    return cfg


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name != "STAGE.json")


def test_extract_writes_the_targets_features(tmp_path, tiny_target):
    cfg = offline(tmp_path, tiny_target)
    estimate = extract.estimate_bytes(make_context(cfg, "extract"))
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract")  # with the full pre-flight
    out = Path(cfg.run_dir) / "extract"
    index = json.loads((out / sh.INDEX).read_text())
    store = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors")
    assert index["samples"] == len(store) and index["tokens"] == store.total_tokens
    assert len(index["shards"]) == row["counts"]["shards"] >= 3
    for entry in index["shards"]:
        assert (out / entry["file"]).stat().st_size == entry["bytes"]
        assert sh.sha256_file(out / entry["file"]) == entry["sha256"]
    # the estimate is what the pre-flight's disk check compares with the free space
    assert abs(estimate - folder_bytes(out)) <= 0.1 * folder_bytes(out)

    # each sample's stored rows are the target's own features of that sample alone (no padding leaks in)
    features = sh.FeatureStore(out)
    target = TargetFeatures(load_target(cfg.target), [2, 4, 5])
    for i in (0, len(store) // 2, len(store) - 1):
        sid, ids, _ = store[i]
        live = target(ids[None], torch.ones_like(ids)[None], with_logits=False)
        aux, last = features[sid]
        assert aux.dtype == torch.bfloat16 and aux.shape == (len(ids), 3 * 128)
        torch.testing.assert_close(aux.float(), live.aux[0].bfloat16().float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(last.float(), live.last_hidden[0].bfloat16().float(), rtol=0.02, atol=0.02)

    # A finished extract with a shard removed (the remedy for a damaged one) is not skipped: it re-extracts that one.
    kept = out / index["shards"][0]["file"]
    kept_mtime = kept.stat().st_mtime_ns
    gone = out / index["shards"][1]["file"]
    gone.unlink()
    sh.sidecar_path(gone).unlink()
    with RunDir(cfg.run_dir).lock:
        again = run_stage(cfg, "extract")
    assert not again.get("skipped") and gone.exists() and kept.stat().st_mtime_ns == kept_mtime
    with RunDir(cfg.run_dir).lock:
        assert run_stage(cfg, "extract").get("skipped") is True


def test_killed_extract_resumes_and_a_damaged_shard_is_named(tmp_path, tiny_target, monkeypatch):
    cfg = offline(tmp_path, tiny_target)
    out = Path(cfg.run_dir) / "extract"
    real_exit = sh.ShardWriter.__exit__

    def die_after_two_shards(self, *exc):
        real_exit(self, *exc)
        if len(list(out.glob("shard-*.json"))) == 2:
            raise KeyboardInterrupt  # the run dies here: two complete shards, no index
    monkeypatch.setattr(sh.ShardWriter, "__exit__", die_after_two_shards)
    with RunDir(cfg.run_dir).lock, pytest.raises(KeyboardInterrupt):
        run_stage(cfg, "extract")
    monkeypatch.setattr(sh.ShardWriter, "__exit__", real_exit)
    assert not (out / sh.INDEX).exists()

    # damage one complete shard: the resumed run's pre-flight names it
    first = out / sh.shard_name(0)
    with open(first, "r+b") as f:
        f.truncate(first.stat().st_size // 2)
    with RunDir(cfg.run_dir).lock, pytest.raises(EaglekitError, match="shard-00000.safetensors is truncated"):
        run_stage(cfg, "extract")

    # following the remedy: delete it; the rerun extracts it and the missing ones, and keeps shard 1 as is
    kept = out / sh.shard_name(1)
    kept_mtime = kept.stat().st_mtime_ns
    first.unlink()
    sh.sidecar_path(first).unlink()
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract")
    assert kept.stat().st_mtime_ns == kept_mtime
    index = json.loads((out / sh.INDEX).read_text())
    assert row["counts"]["shards"] == len(index["shards"]) >= 3
    assert sh.validate_shards(out) == (index["shards"], [])


def test_disk_check_fails_when_features_exceed_free_space(tmp_path, tiny_target, monkeypatch):
    cfg = offline(tmp_path, tiny_target)
    ctx = make_context(cfg, "extract")
    need = extract.estimate_bytes(ctx)
    real = os.statvfs

    class Tiny:
        f_frsize = 4096
        f_bavail = need // 2 // 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if str(p).startswith(str(tmp_path)) else real(p))
    results = {r.name: r for r in run_preflight(ctx)}
    disk = results["disk space"]
    assert disk.status == "fail"
    from eaglekit.preflight.checks import human_bytes
    assert human_bytes(need) in disk.detail and human_bytes(Tiny.f_bavail * 4096) in disk.detail
    assert results["existing shards"].status == "skip"

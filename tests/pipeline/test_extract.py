"""Offline extraction: shards + index that match the live target (bf16 and fp8), resume after kill -9, the
background writer's bottleneck report, two ranks, disk estimate and checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support.helpers import subprocess_env

from eaglekit.config import RunConfig, parse_config
from eaglekit.data import shards as sh
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.model.target import TargetFeatures, load_target
from eaglekit.pipeline import make_context, run_preflight, run_stage
from eaglekit.rundir import RunDir
from eaglekit.stages import extract
from eaglekit.tiny.corpus import sample_tasks, write_responses

pytestmark = pytest.mark.slow  # builds, trains or serves models


def prepared_run(tmp_path: Path, target: Path, n: int = 48, seed: int = 1, **sections) -> RunConfig:
    """A run directory whose prepare and vocab stages are done, on the tiny target's corpus rendered with its
    template (tasks the target was trained on the like of, so its features are meaningful)."""
    gen = tmp_path / "run" / "generate"
    write_responses(gen, sample_tasks(n, seed, split="train"), f"t{seed}-")
    data = {
        "run_dir": "run",
        "target": {"model": str(target)},
        "data": {"prompts": "unused.jsonl", "eval_fraction": 0.1},
        "vocab": {"draft_vocab_size": 200},
        **sections,
    }
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
    stored = [sid for entry in index["shards"] for sid in entry["ids"]]
    assert sorted(stored) == sorted(store.ids)  # every sample exactly once
    for entry in index["shards"]:
        assert (out / entry["file"]).stat().st_size == entry["bytes"]
        assert sh.sha256_file(out / entry["file"]) == entry["sha256"]
    # the estimate is what the pre-flight's disk check compares with the free space
    assert abs(estimate - folder_bytes(out)) <= 0.1 * folder_bytes(out)
    assert row["counts"]["bottleneck"] in ("compute", "disk") and row["counts"]["disk_mb_per_s"] > 0

    # each sample's stored rows are the target's own features of that sample alone (no padding leaks in)
    features = sh.FeatureStore(out)
    target = TargetFeatures(load_target(cfg.target), [2, 4, 5])
    for i in (0, len(store) // 2, len(store) - 1):
        sid, ids, _ = store[i]
        live = target(ids[None], torch.ones_like(ids)[None], with_logits=False)
        rows = features[sid]
        assert rows.aux.dtype == torch.bfloat16 and rows.aux.shape == (len(ids), 3 * 128) and rows.scale_exp is None
        aux, last = features.features(sid)
        torch.testing.assert_close(aux, live.aux[0].bfloat16().float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(last, live.last_hidden[0].bfloat16().float(), rtol=0.02, atol=0.02)

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
    # the hook compares each listed shard's sidecar with the index without hashing: a shard that is not the one
    # the index lists (its sidecar's sha256 differs) is named too
    assert extract.damaged(make_context(cfg, "extract")) is None
    side = sh.sidecar_path(kept)
    side.write_text(json.dumps({**json.loads(side.read_text()), "sha256": "0" * 64}))
    assert kept.name in extract.damaged(make_context(cfg, "extract"))


def test_fp8_features_are_half_the_bytes_and_close(tmp_path, tiny_target):
    """fp8 shards: 4·H + 4 bytes per token (vs 8·H in bf16), and every state of every token within e4m3's
    rounding (3 mantissa bits: relative error at most 1/16 per element, ~2.5 % per state in norm)."""
    cfg = offline(tmp_path, tiny_target)
    cfg.extract.dtype = "fp8"
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract")
    out = Path(cfg.run_dir) / "extract"
    index = json.loads((out / sh.INDEX).read_text())
    hidden = 128
    assert index["bytes_per_token"] == sh.bytes_per_token(hidden, "fp8") == 4 * hidden + 4
    shard_overhead = sum(
        len(sh.header_bytes(e["ids"], e["tokens"], hidden, "fp8", extract._shard_meta(hidden, [2, 4, 5], "hf")))
        + 8 * (e["samples"] + 1)
        for e in index["shards"]
    )
    assert index["bytes"] == index["tokens"] * (4 * hidden + 4) + shard_overhead  # nothing else is stored

    features = sh.FeatureStore(out)
    store = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors")
    target = TargetFeatures(load_target(cfg.target), [2, 4, 5])
    for i in (0, len(store) - 1):
        sid, ids, _ = store[i]
        live = target(ids[None], torch.ones_like(ids)[None], with_logits=False)
        rows = features[sid]
        assert rows.aux.dtype == torch.float8_e4m3fn and rows.scale_exp.shape == (len(ids), 4)
        aux, last = features.features(sid)
        states = list(live.aux[0].split(hidden, -1)) + [live.last_hidden[0]]
        for s, (got, want) in enumerate(zip(list(aux.split(hidden, -1)) + [last], states, strict=False)):
            err = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert float(err.max()) < 0.05, (s, float(err.max()))
            assert float((got - want).abs().max()) <= float(want.abs().max()) / 16 + 1e-6


def test_fp8_codec_scales_each_state_by_a_power_of_two():
    torch.manual_seed(0)
    hidden = 16
    aux = torch.randn(5, 3 * hidden) * torch.tensor([1e-3] * hidden + [1.0] * hidden + [1e4] * hidden)
    last = torch.randn(5, hidden) * 50
    last[2] = 0.0  # an all-zero state stays zero
    rows = sh.encode(aux, last, "fp8")
    assert rows.scale_exp.dtype == torch.int8 and rows.scale_exp.shape == (5, 4)
    # the largest magnitude of each state lands in [224, 448]: e4m3's top binade, never past its ±448
    for s, x in enumerate(list(aux.split(hidden, -1)) + [last]):
        amax = x.abs().amax(-1)
        scaled = amax / torch.pow(2.0, rows.scale_exp[:, s].float())
        live = amax > 0
        assert bool(((scaled[live] > 224) & (scaled[live] <= 448)).all())
    got_aux, got_last = sh.decode(rows)
    assert bool((got_last[2] == 0).all())
    # e4m3 rounds a normal value within 1/16 of itself; below its normal range (2**-6 after scaling) the
    # spacing is 2**-9: at most half of that, scaled back
    got = list(got_aux.split(hidden, -1)) + [got_last]
    for s, want in enumerate(list(aux.split(hidden, -1)) + [last]):
        scale = torch.pow(2.0, rows.scale_exp[:, s].float()).unsqueeze(-1)
        assert bool(((got[s] - want).abs() <= want.abs() / 16 + scale * 2.0**-10).all()), s
    assert sh.bytes_per_token(7168, "bfloat16") == 8 * 7168 and sh.bytes_per_token(7168, "fp8") == 4 * 7168 + 4


KILLED_EXTRACT = textwrap.dedent("""
    import os, signal, sys
    from eaglekit.config import load_config
    from eaglekit.data import shards as sh
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir

    commit = sh.ShardWriter.commit
    def commit_then_die(self):
        entry = commit(self)
        if len(list(self.path.parent.glob("shard-*.json"))) == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # a hard kill: open shards stay as temp files, no index
        return entry
    sh.ShardWriter.commit = commit_then_die
    cfg = load_config(sys.argv[1])
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract")
""")


def test_kill_9_extract_resumes_at_the_first_uncommitted_shard(tmp_path, tiny_target):
    whole = offline(tmp_path / "whole", tiny_target)
    killed = offline(tmp_path / "killed", tiny_target)
    with RunDir(whole.run_dir).lock:
        run_stage(whole, "extract")

    out = Path(killed.run_dir) / "extract"
    config = Path(killed.run_dir) / "config.yaml"
    config.write_text(killed.to_yaml())
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXTRACT, str(config), "2"],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    committed = sorted(p.name for p in out.glob("shard-*.json"))
    assert len(committed) == 2 and not (out / sh.INDEX).exists()
    from eaglekit.status import stage_rows

    row = next(r for r in stage_rows(killed) if r["stage"] == "extract")
    assert row["state"] == "incomplete" and row["counts"]["shards_committed"] == 2
    kept = {
        p.with_suffix(".safetensors"): p.with_suffix(".safetensors").stat().st_mtime_ns
        for p in out.glob("shard-*.json")
    }

    with RunDir(killed.run_dir).lock:
        row = run_stage(killed, "extract")  # `eaglekit extract CONFIG` again
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in kept.items())  # committed shards untouched
    assert not list(out.glob(".*.tmp"))  # the killed run's partial shard is gone
    index = json.loads((out / sh.INDEX).read_text())
    assert row["counts"]["shards"] == len(index["shards"]) >= 3
    ids = [sid for e in index["shards"] for sid in e["ids"]]
    assert len(ids) == len(set(ids)) == index["samples"]  # no sample twice
    # the resumed extraction stores exactly what the uninterrupted one does
    reference = sh.FeatureStore(Path(whole.run_dir) / "extract")
    resumed = sh.FeatureStore(out)
    for sid in ids:
        a, b = reference[sid], resumed[sid]
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last_hidden, b.last_hidden)


def test_a_damaged_shard_is_named_and_the_remedy_reextracts_only_it(tmp_path, tiny_target):
    cfg = offline(tmp_path, tiny_target)
    out = Path(cfg.run_dir) / "extract"
    commit = sh.ShardWriter.commit
    calls = []

    def die_after_two(self):
        entry = commit(self)
        calls.append(entry)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the writer: reported to the stage, committed shards stay
        return entry

    sh.ShardWriter.commit = die_after_two
    try:
        with RunDir(cfg.run_dir).lock, pytest.raises(KeyboardInterrupt) as stopped:
            run_stage(cfg, "extract")
    finally:
        sh.ShardWriter.commit = commit
    assert len(list(out.glob("shard-*.json"))) == 2 and not (out / sh.INDEX).exists()
    # what the interrupted command prints says what is kept (the stage's kept() hook)
    assert (
        "2 committed shards" in stopped.value.eaglekit_note and "rerun the same command" in stopped.value.eaglekit_note
    )

    # damage one complete shard: the resumed run's pre-flight names it
    first = out / calls[0]["file"]
    with open(first, "r+b") as f:
        f.truncate(first.stat().st_size // 2)
    with RunDir(cfg.run_dir).lock, pytest.raises(EaglekitError, match=f"{first.name} is truncated"):
        run_stage(cfg, "extract")

    # following the remedy: delete it; the rerun extracts it and the missing ones, and keeps the other as is
    kept = out / calls[1]["file"]
    kept_mtime = kept.stat().st_mtime_ns
    first.unlink()
    sh.sidecar_path(first).unlink()
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract")
    assert kept.stat().st_mtime_ns == kept_mtime
    index = json.loads((out / sh.INDEX).read_text())
    assert row["counts"]["shards"] == len(index["shards"]) >= 3
    assert sh.validate_shards(out) == (index["shards"], [])


@pytest.mark.parametrize("slow", ["disk", "compute"])
def test_the_stage_names_its_bottleneck(tmp_path, tiny_target, monkeypatch, slow):
    """A slow disk makes the computation wait on the bounded queue; a slow target leaves the writer idle."""
    cfg = offline(tmp_path, tiny_target)
    cfg.extract.writer_queue = 1
    if slow == "disk":
        # as slow as the slow target below: 0.02 s a write was faster than the target itself on an AVX2-only EPYC
        write = sh.ShardWriter.write
        monkeypatch.setattr(sh.ShardWriter, "write", lambda self, j, rows: (time.sleep(0.3), write(self, j, rows))[1])
    else:
        call = TargetFeatures.__call__
        monkeypatch.setattr(TargetFeatures, "__call__", lambda self, *a, **k: (time.sleep(0.3), call(self, *a, **k))[1])
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract", skip_preflight=True)
    assert row["counts"]["bottleneck"] == slow


def extract_worker(rank: int, world: int, port: int, config: str) -> None:
    from test_train_ddp import torchrun_env

    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage_as_worker

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    cfg = load_config(config)
    if rank == 0:
        with RunDir(cfg.run_dir).lock:
            run_stage(cfg, "extract")
    else:
        run_stage_as_worker(cfg, "extract")


def test_two_ranks_extract_disjoint_shards_into_one_index(tmp_path, tiny_target):
    from test_train_ddp import free_port

    single = offline(tmp_path / "single", tiny_target)
    with RunDir(single.run_dir).lock:
        run_stage(single, "extract")
    cfg = offline(tmp_path / "two", tiny_target)
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    mp.spawn(extract_worker, args=(2, free_port(), str(config)), nprocs=2, join=True)
    out = Path(cfg.run_dir) / "extract"
    index = json.loads((out / sh.INDEX).read_text())
    reference = json.loads((Path(single.run_dir) / "extract" / sh.INDEX).read_text())
    assert [e["ids"] for e in index["shards"]] == [e["ids"] for e in reference["shards"]]
    assert [e["sha256"] for e in index["shards"]] == [e["sha256"] for e in reference["shards"]]  # the same bytes


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
    from eaglekit.progress import human_bytes

    assert human_bytes(need) in disk.detail and human_bytes(Tiny.f_bavail * 4096) in disk.detail
    assert results["existing shards"].status == "skip"

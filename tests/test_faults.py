"""Nothing silent under faults: a feature shard whose bytes changed on disk, a step whose loss or gradient is not
finite, a drafter checkpoint with non-finite weights, and a peer rank that dies or never joins. Each stops with an
EaglekitError that names the file, step, tensor or rank, and the remedy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_extract import offline

from eaglekit.data import shards as sh
from eaglekit.pipeline import make_context, run_stage
from eaglekit.preflight import files
from eaglekit.rundir import RunDir
from eaglekit.stages import extract, train

pytestmark = pytest.mark.slow  # builds, trains or serves models


# ------------------------------------------------------------------------------------- shard contents


def flip_a_byte(path: Path) -> None:
    """One byte in the middle of the file changed, the size kept: what a bad disk or copy does."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_shard_whose_bytes_changed_fails_trains_preflight_and_extract_redoes_only_it(
    tmp_path, tiny_target, monkeypatch
):
    cfg = offline(tmp_path, tiny_target)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract", skip_preflight=True)
    out = Path(cfg.run_dir) / "extract"
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) >= 3 and files.feature_shard_contents in train.checks(cfg)

    hashed: list[str] = []
    real_sha = sh.sha256_file
    monkeypatch.setattr(sh, "sha256_file", lambda path, *a: hashed.append(Path(path).name) or real_sha(path, *a))
    first = files.feature_shard_contents(make_context(cfg, "train"))
    assert first.status == "ok" and "all hashed now" in first.detail, first.detail
    assert sorted(hashed) == [s.name for s in shards]
    # the cache (in the run directory) spares a rerun the hashing: nothing is read again
    hashed.clear()
    again = files.feature_shard_contents(make_context(cfg, "train"))
    assert again.status == "ok" and hashed == [], again.detail
    assert set(json.loads((out / sh.DIGEST_CACHE).read_text())) == {s.name for s in shards}

    bad = shards[1]
    expected = json.loads(sh.sidecar_path(bad).read_text())["sha256"]
    flip_a_byte(bad)
    actual = real_sha(bad)
    hashed.clear()
    result = files.feature_shard_contents(make_context(cfg, "train"))
    assert hashed == [bad.name]  # only the changed file is read again
    assert result.status == "fail"
    assert bad.name in result.detail and expected in result.detail and actual in result.detail
    assert "--from extract" in result.remedy and "only that shard" in result.remedy
    # the header and size checks see nothing wrong: only the bytes differ
    assert files.feature_shards(make_context(cfg, "train")).status == "ok"

    # the remedy: the finished extract counts that shard as damaged and re-extracts it, and only it
    ctx = make_context(cfg, "extract")
    assert bad.name in (extract.damaged(ctx) or "") and actual in extract.damaged(ctx)
    assert extract.existing_shards(ctx).status == "ok" and "re-extracted" in extract.existing_shards(ctx).detail
    others = {s.name: s.stat().st_mtime_ns for s in shards if s != bad}
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract")
    assert not row.get("skipped")
    assert {s.name: s.stat().st_mtime_ns for s in shards if s != bad} == others
    assert real_sha(bad) == json.loads(sh.sidecar_path(bad).read_text())["sha256"]
    assert extract.damaged(make_context(cfg, "extract")) is None
    assert files.feature_shard_contents(make_context(cfg, "train")).status == "ok"

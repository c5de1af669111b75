"""Atomic writes: the old file survives a failed write, and the result is readable like a plainly written file."""

from __future__ import annotations

import os
import stat

import pytest

from eaglekit import atomic


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.json"
    atomic.write_json(path, {"v": 1})
    with pytest.raises(RuntimeError), atomic.atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text().strip().startswith("{") and '"v": 1' in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"], "no temp file left behind"


def test_atomic_dir_replaces_whole_and_has_plain_permissions(tmp_path):
    out = tmp_path / "ckpt"
    with atomic.atomic_dir(out) as d:
        (d / "w.bin").write_bytes(b"1")
    with atomic.atomic_dir(out) as d:
        (d / "x.bin").write_bytes(b"2")
    assert sorted(p.name for p in out.iterdir()) == ["x.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "x.bin").stat().st_mode) == 0o666 & ~umask
    atomic.write_text(tmp_path / "t.txt", "x")
    assert stat.S_IMODE((tmp_path / "t.txt").stat().st_mode) == 0o666 & ~umask

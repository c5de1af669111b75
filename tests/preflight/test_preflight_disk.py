"""Disk checks: free bytes and inodes on a real, small tmpfs (as root), the write probe, and the filesystem type
with network-backed volumes recognised from mountinfo lines and sysfs."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from support.helpers import mounted_tmpfs as tmpfs

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.contract import Estimate
from eaglekit.preflight import disk
from eaglekit.progress import human_bytes


def ctx_on(root, tmp_path, stage="vocab", **sections):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    data = {
        "run_dir": str(root / "run"),
        "target": {"model": str(target)},
        "data": {"prompts": str(prompts)},
        "vocab": {"draft_vocab_size": 100},
        **sections,
    }
    return pipeline.make_context(parse_config(data, base_dir=tmp_path), stage)


def fill(folder, n_bytes: int) -> None:
    with open(folder / "filler.bin", "wb") as f:
        f.write(os.urandom(n_bytes))


def test_no_space_on_a_full_tmpfs_fails_naming_need_and_free(tmp_path):
    with tmpfs(tmp_path / "vol", "8m") as vol:
        fill(vol, 6 * 2**20)  # 2 MiB left; vocab writes ~4.4 MB
        ctx = ctx_on(vol, tmp_path)
        result = disk.disk_space(ctx)
        assert result.status == "fail", result.detail
        need = human_bytes(ctx.estimate().bytes)
        assert f"writes about {need}" in result.detail and f"{vol}" in result.detail and "2.1 MB free" in result.detail
        assert "eaglekit plan" in result.remedy
        probe = disk.write_rate(ctx)
        assert probe.status == "skip" and "no room to probe" in probe.detail


def test_no_inodes_left_fails_even_with_bytes_free(tmp_path):
    with tmpfs(tmp_path / "vol", "64m", inodes=40) as vol:
        for i in range(40):
            try:
                (vol / f"f{i}").touch()
            except OSError:
                break
        result = disk.disk_space(ctx_on(vol, tmp_path))
        assert result.status == "fail" and "free inodes" in result.detail and "1,000 files" in result.detail


def test_enough_space_and_inodes_raise_no_alarm(tmp_path):
    with tmpfs(tmp_path / "vol", "64m") as vol:
        ctx = ctx_on(vol, tmp_path)
        result = disk.disk_space(ctx)
        need = human_bytes(ctx.estimate().bytes)
        assert result.status == "ok" and f"about {need} needed" in result.detail and "inodes free" in result.detail
        fs = disk.filesystem(ctx_on(vol, tmp_path))
        assert fs.status == "ok" and fs.detail.startswith("tmpfs on tmpfs") and f"mounted at {vol}" in fs.detail


def test_write_probe_measures_and_compares_with_the_stages_need(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "vol", "64m") as vol:
        ctx = ctx_on(vol, tmp_path, preflight={"disk_probe_mb": 8})
        plain = disk.write_rate(ctx)
        assert plain.status == "ok" and "8.0 MB written and fsynced" in plain.detail
        assert not [p for p in vol.rglob(".eaglekit-write-probe-*")]  # the probe cleans up after itself

        written, seconds = disk.probe_write_rate(vol, 8_000_000, 2.0)  # cached: the same figure as the check's
        rate = written / seconds
        ctx = ctx_on(vol, tmp_path, preflight={"disk_probe_mb": 8})
        ctx.declared = replace(ctx.stage_def, estimate=lambda c, s: Estimate(write_rate=(rate * 10, "a test's need")))
        slow = disk.write_rate(ctx)
        assert slow.status == "warn" and "disk-bound" in slow.detail and "10.0× slower" in slow.detail
        ctx = ctx_on(vol, tmp_path, preflight={"disk_probe_mb": 8})
        ctx.declared = replace(ctx.stage_def, estimate=lambda c, s: Estimate(write_rate=(rate / 10, "a test's need")))
        assert disk.write_rate(ctx).status == "ok"


def test_a_failing_write_probe_is_a_fail(tmp_path, monkeypatch):
    def broken(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk, "probe_write_rate", broken)
    result = disk.write_rate(ctx_on(tmp_path, tmp_path, preflight={"disk_probe_mb": 1}))
    assert result.status == "fail" and "Input/output error" in result.detail


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/nfs rw,relatime shared:1 - nfs4 filer:/export/runs rw,vers=4.2
41 27 0:51 / /mnt/ceph rw - ceph 10.0.0.1:6789:/ rw
42 27 0:52 / /mnt/juice rw - fuse.juicefs JuiceFS:vol rw
43 27 252:0 / /mnt/rbd rw - xfs /dev/rbd0 rw
44 27 253:0 / /mnt/dm rw - xfs /dev/mapper/vg-lv rw
45 27 0:53 / /var/lib/overlay rw - fuse.fuse-overlayfs fuse-overlayfs rw
46 27 259:1 / /mnt/my\\040disk rw - ext4 /dev/nvme0n1p1 rw
47 40 0:54 / /mnt/nfs/scratch rw - tmpfs tmpfs rw
"""


def test_mountinfo_finds_the_mount_and_tells_network_from_local(tmp_path):
    mounts = disk.parse_mountinfo(MOUNTINFO)
    sys_block = tmp_path / "sys"  # a sysfs where 253:0 is device-mapper over the Ceph RBD disk rbd1
    (tmp_path / "devices/virtual/block/dm-0/slaves").mkdir(parents=True)
    (tmp_path / "devices/rbd/rbd1").mkdir(parents=True)
    (tmp_path / "devices/virtual/block/dm-0/slaves/rbd1").symlink_to(tmp_path / "devices/rbd/rbd1")
    sys_block.mkdir()
    (sys_block / "253:0").symlink_to(tmp_path / "devices/virtual/block/dm-0")

    def kind(path):
        m = disk.mount_of(disk.Path(path), mounts)
        return m.mount_point, disk.network_backing(m, sys_block)

    assert kind("/mnt/nfs/runs/x") == ("/mnt/nfs", "a nfs4 network filesystem (filer:/export/runs)")
    assert kind("/mnt/nfs/scratch/run") == ("/mnt/nfs/scratch", None)  # a local mount inside the NFS one
    assert "ceph" in kind("/mnt/ceph/a")[1]
    assert "FUSE" in kind("/mnt/juice/a")[1]
    assert kind("/mnt/rbd/run")[1] == "the network block device /dev/rbd0"
    assert kind("/mnt/dm/run")[1] == "/dev/mapper/vg-lv on the network block device rbd1"
    assert kind("/var/lib/overlay/x")[1] is None
    assert kind("/mnt/my disk/run") == ("/mnt/my disk", None)
    assert kind("/home/me/run") == ("/", None)
    assert kind("/mnt/nfsx/run") == ("/", None)  # a sibling whose name starts the same is not inside


def test_a_run_dir_on_nfs_warns_and_local_disk_does_not(tmp_path, monkeypatch):
    info = tmp_path / "mountinfo"
    info.write_text(f"27 1 254:0 / / rw - ext4 /dev/vda rw\n40 27 0:50 / {tmp_path} rw - nfs4 filer:/export rw\n")
    monkeypatch.setattr(disk, "MOUNTINFO", str(info))
    result = disk.filesystem(ctx_on(tmp_path, tmp_path))
    assert result.status == "warn" and "nfs4 network filesystem (filer:/export)" in result.detail and result.remedy
    info.write_text("27 1 254:0 / / rw - ext4 /dev/vda rw\n")
    assert disk.filesystem(ctx_on(tmp_path, tmp_path)).status == "ok"

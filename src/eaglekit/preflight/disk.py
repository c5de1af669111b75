"""Disk: free bytes and inodes where a stage writes, the filesystem under it, and how fast it takes data.

Free space is ``f_bavail`` (what an unprivileged writer gets, not ``f_bfree``), compared with the stage's own
estimate (``ctx.estimate().bytes``: the stage's declared ``estimate``); inodes likewise (``.files``, else a floor). The filesystem
comes from ``/proc/self/mountinfo``: the mount holding the output folder, its type and source, and whether it
is network-backed (NFS, CIFS, Ceph, Lustre, GPFS, FUSE, or a block device over the network: RBD, NBD, iSCSI) —
there a lock taken on one host does not stop a writer on another, and fsync costs a round trip. The write
probe writes incompressible data sequentially and fsyncs it, so neither compression nor the page cache
flatters the figure; it is compared with the rate the stage needs (``.write_rate``; extract: bytes per token × the target's
measured tokens per second).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eaglekit.contract import StageContext
from eaglekit.preflight import CheckResult, fail, ok, skip, warn
from eaglekit.progress import human_bytes

MIN_FREE_INODES = 1000  # a stage that does not say how many files it writes gets this floor
MOUNTINFO = "/proc/self/mountinfo"
NETWORK_FS = {
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "ceph",
    "glusterfs",
    "lustre",
    "gpfs",
    "beegfs",
    "wekafs",
    "9p",
    "afs",
    "gfs2",
    "ocfs2",
    "orangefs",
    "pvfs2",
    "panfs",
    "davfs",
    "sshfs",
    "virtiofs",
}
LOCAL_FUSE = {"fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"}
NETWORK_BLOCK = re.compile(r"^(rbd|nbd|drbd)\d")  # Ceph RBD, network block device, DRBD
PROBE_CHUNK = 4 << 20


def existing_ancestor(path: Path) -> Path:
    """``path`` itself or its nearest existing parent: where the stage's files will land."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("/"))


# ------------------------------------------------------------------------------------------ free space


def disk_space(ctx: StageContext) -> CheckResult:
    """Free bytes and inodes at the output folder vs what the stage writes."""
    need = need_files = None
    try:
        estimate = ctx.estimate()
        need, need_files = estimate.bytes, estimate.files
    except Exception as err:  # noqa: BLE001 - an estimate that needs missing upstream outputs cannot be made yet
        note = f"; the stage cannot estimate its size yet ({type(err).__name__})"
    else:
        note = ""
    where = existing_ancestor(ctx.dir)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    total_inodes, free_inodes = getattr(st, "f_files", 0), getattr(st, "f_favail", 0)
    inodes = total_inodes > 0  # some filesystems (btrfs, many network ones) report no inode limit
    want_inodes = need_files or MIN_FREE_INODES
    name = "disk space"
    if need is not None and need > free:
        return fail(
            name,
            f"the stage writes about {human_bytes(need)} but {where} has {human_bytes(free)} free",
            "free space, point run_dir at a larger volume, or reduce data.max_samples "
            "(`eaglekit plan CONFIG` computes how many samples fit)",
        )
    if inodes and free_inodes < want_inodes:
        return fail(
            name,
            f"{where} has {free_inodes:,} free inodes; the stage creates about {want_inodes:,} files",
            "delete files on that filesystem or use another one (a filesystem's inode count is fixed when it is made)",
        )
    inode_note = f", {free_inodes:,} inodes free" if inodes else ""
    if need is None:
        return ok(name, f"{human_bytes(free)} free on {where}{inode_note}{note}")
    if need > 0.8 * free:
        return warn(
            name,
            f"about {human_bytes(need)} of {human_bytes(free)} free on {where} will be used{inode_note}",
            "leave margin: other stages and checkpoints need room too",
        )
    return ok(name, f"about {human_bytes(need)} needed, {human_bytes(free)} free on {where}{inode_note}")


# ------------------------------------------------------------------------------------------ filesystem


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    device: str  # "major:minor"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """``/proc/self/mountinfo`` lines: ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 7:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]), fields[2]))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount a path lives on: the last-mounted one with the longest mount point above it."""
    path_str = str(path)
    best = None
    for m in mounts:  # later lines win ties: they are mounted over the earlier ones
        mp = m.mount_point.rstrip("/") or "/"
        inside = path_str == mp or path_str.startswith(mp if mp == "/" else mp + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def network_backing(m: Mount, sys_block: Path = Path("/sys/dev/block")) -> str | None:
    """Why a mount is network-backed ("nfs4", "Ceph RBD block device rbd0", …), or None when it is local."""
    fstype = m.fstype
    if fstype in NETWORK_FS or fstype.split(".")[0] in NETWORK_FS:
        return f"a {fstype} network filesystem ({m.source})"
    if (fstype == "fuse" or fstype.startswith("fuse.")) and fstype not in LOCAL_FUSE:
        return f"a FUSE filesystem ({fstype}, {m.source}), usually remote storage"
    name = Path(m.source).name
    if NETWORK_BLOCK.match(name):
        return f"the network block device {m.source}"
    try:  # device-mapper, partitions and iSCSI: follow the block device in sysfs
        real = (sys_block / m.device).resolve(strict=True)
    except OSError:
        return None
    if "/session" in str(real):
        return f"an iSCSI disk ({m.source})"
    for dev in _block_ancestry(real):
        if NETWORK_BLOCK.match(dev):
            return f"{m.source} on the network block device {dev}"
    return None


def _block_ancestry(real: Path, depth: int = 0) -> list[str]:
    names = [real.name, real.parent.name]
    slaves = real / "slaves"
    if depth < 4 and slaves.is_dir():
        for s in slaves.iterdir():
            names += _block_ancestry(s.resolve(), depth + 1)
    return names


def read_mounts() -> list[Mount]:
    try:
        return parse_mountinfo(Path(MOUNTINFO).read_text())
    except OSError:
        return []


def filesystem(ctx: StageContext) -> CheckResult:
    """The filesystem under the output folder, and whether it is network-backed."""
    where = existing_ancestor(ctx.dir).resolve()
    m = mount_of(where, read_mounts())
    if m is None:
        return skip("filesystem", f"{MOUNTINFO} does not say which mount holds {where}")
    network = network_backing(m)
    if network:
        return warn(
            "filesystem",
            f"{where} is on {network}: eaglekit's run lock (flock) cannot stop a writer on "
            "another host, and every fsync is a network round trip",
            "run one eaglekit process per run directory across all hosts; prefer a local NVMe for "
            "extract's features (see the write rate)",
        )
    return ok("filesystem", f"{m.fstype} on {m.source} (mounted at {m.mount_point}), local")


# ------------------------------------------------------------------------------------------ write rate


@functools.lru_cache(maxsize=16)
def _probe(device: int, folder: str, size: int, max_seconds: float) -> tuple[int, float]:
    """(bytes, seconds) of a sequential, fsync'd write of random data; once per filesystem and process."""
    written, busy = 0, 0.0
    fd, tmp = tempfile.mkstemp(prefix=".eaglekit-write-probe-", dir=folder)
    try:
        while written < size and busy < max_seconds:
            chunk = os.urandom(min(PROBE_CHUNK, size - written))  # fresh random data: nothing to compress or dedupe
            t0 = time.perf_counter()
            os.write(fd, chunk)
            busy += time.perf_counter() - t0
            written += len(chunk)
        t0 = time.perf_counter()
        os.fsync(fd)
        busy += time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(tmp)
    return written, busy


def probe_write_rate(folder: Path, size: int, max_seconds: float) -> tuple[int, float]:
    return _probe(os.stat(folder).st_dev, str(folder), size, max_seconds)


def write_rate(ctx: StageContext) -> CheckResult:
    """A short write probe where the stage writes, vs the rate the stage needs."""
    name = "write rate"
    p = ctx.cfg.preflight
    if p.disk_probe_mb == 0:
        return skip(name, "preflight.disk_probe_mb is 0")
    folder = existing_ancestor(ctx.run.path if ctx.run.path.exists() else ctx.dir)
    size = int(p.disk_probe_mb * 1e6)
    st = os.statvfs(folder)
    if st.f_bavail * st.f_frsize < 2 * size:
        return skip(name, f"only {human_bytes(st.f_bavail * st.f_frsize)} free on {folder}: no room to probe")
    if not os.access(folder, os.W_OK):
        return skip(name, f"{folder} is not writable (see the output folder check)")
    try:
        written, seconds = probe_write_rate(folder, size, p.disk_probe_seconds)
    except OSError as err:
        return fail(
            name,
            f"writing a {human_bytes(size)} probe into {folder} failed: {err.strerror or err}",
            "fix the filesystem (full? read-only? a dead network mount?) before a long run",
        )
    rate = written / max(seconds, 1e-9)
    measured = f"{human_bytes(rate)}/s ({human_bytes(written)} written and fsynced in {seconds:.2f} s, {folder})"
    try:
        need = ctx.estimate().write_rate
    except Exception:  # noqa: BLE001 - the disk space check says the estimate cannot be made yet, and why
        need = None
    if need is None:
        return ok(name, measured)
    need_rate, why = need
    if need_rate > rate:
        return warn(
            name,
            f"the stage needs {human_bytes(need_rate)}/s ({why}) but the disk takes {measured}: "
            f"it will be disk-bound, about {need_rate / rate:.1f}× slower than its compute allows",
            "put run_dir on faster local storage, or shrink what is written (extract.mode: online, "
            "or 8-bit features); `eaglekit plan CONFIG` shows the time either way",
        )
    return ok(name, f"{measured} ≥ the {human_bytes(need_rate)}/s the stage needs ({why})")

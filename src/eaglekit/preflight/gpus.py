"""GPUs, every one of them, through NVML (``nvidia-ml-py``, imported as ``pynvml``) — the driver's own library.

Per GPU: index, UUID, name, memory used/total, utilisation, the compute processes on it (their pids, including
those of other containers that this PID namespace cannot see), uncorrected ECC errors since the driver
loaded, and retired pages / remapped rows waiting for a reset. Across GPUs: whether memory use is uniform
where a sharded model should sit on all of them (one of eight GPUs nearly empty means a tensor-parallel
worker died or never loaded), and whether the GPUs this stage uses have the memory it needs.

Without a driver (a CPU machine, a container without the NVIDIA runtime) every GPU check is a ``skip`` that says
why. ``nvidia-smi`` is never parsed: its text changes between driver versions, NVML's API does not.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from eaglekit.contract import StageContext
from eaglekit.preflight import CheckResult, fail, ok, skip, warn
from eaglekit.preflight.files import read_weights
from eaglekit.progress import human_bytes

LOADED_SHARE = 0.25  # a GPU whose memory is at least this full holds (a shard of) a model
LOW_SHARE_OF_MEDIAN = 0.5  # one that uses less than this share of the loaded GPUs' median stands out
HEADROOM = 1.2  # weights plus activations, KV cache and the allocator's slack
TARGET_STAGES = ("extract", "evaluate")  # stages that load the target onto the GPUs


@dataclass
class GPU:
    index: int
    uuid: str
    name: str
    total: int
    used: int
    utilization: int | None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes used)
    ecc_uncorrected: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None

    @property
    def free(self) -> int:
        return self.total - self.used

    def line(self) -> str:
        util = f", {self.utilization}% busy" if self.utilization is not None else ""
        ecc = f", {self.ecc_uncorrected} uncorrected ECC" if self.ecc_uncorrected is not None else ""
        pids = [f"{pid}{'' if psutil.pid_exists(pid) else ' (other namespace)'}" for pid, _ in self.processes[:4]]
        more = f" +{len(self.processes) - 4}" if len(self.processes) > 4 else ""
        procs = f", pids {', '.join(pids)}{more}" if pids else ""
        return (
            f"GPU {self.index} {self.name} {self.uuid}: {human_bytes(self.used)} of {human_bytes(self.total)} "
            f"used{util}{ecc}{procs}"
        )


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def inventory() -> list[GPU] | str:
    """Every GPU NVML sees, or the reason there are none (no library, no driver)."""
    try:
        import pynvml  # lazy: optional (its absence is a pre-flight finding)
    except ImportError:
        return "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"no NVIDIA driver here (NVML: {err})"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(
                GPU(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    total=int(mem.total),
                    used=int(mem.used),
                    utilization=_optional(pynvml, lambda h=h: int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)),
                    processes=[
                        (int(p.pid), _bytes(p.usedGpuMemory))
                        for p in _optional(pynvml, lambda h=h: pynvml.nvmlDeviceGetComputeRunningProcesses(h)) or []
                    ],
                    ecc_uncorrected=_optional(
                        pynvml,
                        lambda h=h: int(
                            pynvml.nvmlDeviceGetTotalEccErrors(
                                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                            )
                        ),
                    ),
                    retired_pending=_optional(
                        pynvml,
                        lambda h=h: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED,
                    ),
                )
            )
            remap = _optional(pynvml, lambda h=h: pynvml.nvmlDeviceGetRemappedRows(h))
            if remap is not None:  # (corrected rows, uncorrected rows, reset pending, remapping failed)
                gpus[-1].remap_pending, gpus[-1].remap_failed = bool(remap[2]), bool(remap[3])
        return gpus
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _optional(pynvml, query):
    """A query some GPUs do not support (ECC on consumer cards, row remapping before Ampere): None there."""
    try:
        return query()
    except pynvml.NVMLError:
        return None


def _bytes(value) -> int | None:
    # NVML reports "not available" (e.g. under MIG or without permission) as a huge sentinel
    return int(value) if value is not None and int(value) < (1 << 62) else None


def visible(gpus: list[GPU], env: dict | None = None) -> list[GPU]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes) or all of them."""
    spec = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return gpus
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.isdigit():
            match = [g for g in gpus if g.index == int(item)]
        else:
            match = [g for g in gpus if g.uuid.startswith(item)]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        chosen += match
    return chosen


def _pid_note(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"pid {pid} `{' '.join(p.cmdline())[:80] or p.name()}`"
    except psutil.NoSuchProcess:
        return f"pid {pid} (not in this PID namespace: another container or the host)"
    except psutil.AccessDenied:
        return f"pid {pid} (another user's)"


def need_per_gpu(ctx: StageContext, used: list[GPU]) -> tuple[int, str] | None:
    """(bytes, why) each GPU the stage uses must have free: the target's weights, spread by device_map or not."""
    cfg = ctx.cfg
    loads_target = (
        ctx.stage in TARGET_STAGES
        or (ctx.stage == "generate" and cfg.generate.backend == "local")
        or (ctx.stage == "train" and cfg.extract.online)
    )
    if not loads_target or not used or not Path(cfg.target.model).is_dir():
        return None
    weights = read_weights(cfg.target.model).bytes
    if not weights:
        return None
    spread = len(used) if cfg.target.device_map else 1
    need = int(weights * HEADROOM / spread)
    how = f"over {spread} GPUs (target.device_map)" if spread > 1 else "on each GPU (one copy per process)"
    return need, f"the target's {human_bytes(weights)} of weights × {HEADROOM} {how}"


def gpus(ctx: StageContext) -> list[CheckResult]:
    """Every GPU's state; a fail for broken memory or too little of it; a warn for uneven use or foreign processes."""
    found = inventory()
    if isinstance(found, str):
        return [skip("GPUs", found)]
    if not found:
        return [skip("GPUs", "the NVIDIA driver is loaded but reports no GPU")]
    used = visible(found)
    results = [
        ok(
            "GPUs",
            f"{len(found)} GPU(s), {len(used)} visible to this process"
            + (
                f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                if "CUDA_VISIBLE_DEVICES" in os.environ
                else ""
            )
            + ":\n"
            + "\n".join(g.line() for g in found),
        )
    ]
    results += health(found)
    results += uniformity(found)
    results += memory_for_stage(ctx, used)
    return results


def health(found: list[GPU]) -> list[CheckResult]:
    out = []
    for g in found:
        if g.ecc_uncorrected:
            out.append(
                fail(
                    f"GPU {g.index} memory",
                    f"{g.name} {g.uuid} has had {g.ecc_uncorrected} uncorrected ECC "
                    "error(s) since the driver loaded: what it computes may be corrupt",
                    "drain the GPU and reset it (or reboot the node) before a long run; exclude it meanwhile "
                    "with CUDA_VISIBLE_DEVICES",
                )
            )
        elif g.remap_failed:
            out.append(
                fail(
                    f"GPU {g.index} memory",
                    f"{g.name} {g.uuid}: a row remapping failed (the GPU is out of spare memory rows)",
                    "have the GPU serviced; exclude it with CUDA_VISIBLE_DEVICES",
                )
            )
        elif g.remap_pending or g.retired_pending:
            what = "remapped rows" if g.remap_pending else "retired pages"
            out.append(
                warn(
                    f"GPU {g.index} memory",
                    f"{g.name} {g.uuid} has {what} pending: they take effect at the next reset",
                    "reset the GPU when it is idle",
                )
            )
    return out


def uniformity(found: list[GPU]) -> list[CheckResult]:
    """Most GPUs loaded and one (or a few) far below them: a shard of a model is missing."""
    loaded = [g for g in found if g.used >= LOADED_SHARE * g.total]
    if len(found) < 2 or len(loaded) * 2 < len(found):
        return []
    median = statistics.median(g.used for g in loaded)
    low = [g for g in found if g.used < LOW_SHARE_OF_MEDIAN * median]
    if not low:
        return []
    names = ", ".join(f"GPU {g.index} ({human_bytes(g.used)})" for g in low)
    return [
        warn(
            "GPU memory spread",
            f"{names} use far less memory than the {len(loaded)} others (median "
            f"{human_bytes(median)}): if a server shards the model over all of them, "
            "a worker on those GPUs died or never loaded",
            "check the server's logs and restart it; a healthy tensor-parallel server uses about the same "
            "memory on every GPU",
        )
    ]


def memory_for_stage(ctx: StageContext, used: list[GPU]) -> list[CheckResult]:
    out = []
    need = need_per_gpu(ctx, used)
    if need is not None:
        per_gpu, why = need
        short = [g for g in used if g.free < per_gpu]
        if short:
            out.append(
                fail(
                    "GPU free memory",
                    f"{why} needs {human_bytes(per_gpu)} free per GPU; "
                    + ", ".join(f"GPU {g.index} has {human_bytes(g.free)}" for g in short),
                    "stop what holds that memory (see the GPU processes), set target.device_map: auto to "
                    "shard the target, or pick free GPUs with CUDA_VISIBLE_DEVICES",
                )
            )
        else:
            out.append(
                ok(
                    "GPU free memory",
                    f"{why}: {human_bytes(per_gpu)} per GPU; the least free has "
                    f"{human_bytes(min(g.free for g in used))}",
                )
            )
    if ctx.stage == "generate" and ctx.cfg.generate.backend == "openai":
        return out  # the servers' own processes are expected on the GPUs
    mine = os.getpid()
    foreign = [(g, pid, b) for g in used for pid, b in g.processes if pid != mine]
    if foreign:
        listed = "; ".join(
            f"GPU {g.index}: {_pid_note(pid)}" + (f" holds {human_bytes(b)}" if b else "") for g, pid, b in foreign[:8]
        )
        out.append(
            warn(
                "GPU processes",
                f"{len(foreign)} other compute process(es) on the GPUs this stage uses: {listed}",
                "stop them if they are left from an earlier run; they compete for memory and time",
            )
        )
    return out


def target_placement(ctx: StageContext):
    """Under torchrun every rank loads its own copy of the target onto its own GPU; device_map would spread
    each rank's copy over all GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and ctx.cfg.target.device_map:
        return fail(
            "target placement",
            f"target.device_map is '{ctx.cfg.target.device_map}' under torchrun with "
            f"{world} processes: each would spread its own copy over every GPU",
            "unset target.device_map (one copy per GPU), or run a single process with device_map to shard "
            "a target too big for one GPU",
        )
    where = f"one copy per process ({world})" if world > 1 else (ctx.cfg.target.device_map or "one device")
    return ok("target placement", where)

"""A stand-in for ``pynvml`` (nvidia-ml-py) with the calls eaglekit's GPU checks make, for machines without GPUs.

``fake_pynvml(gpus)`` returns a module object; put it in ``sys.modules["pynvml"]``. Each GPU is a dict:
name, uuid, total, used (bytes), util (%), processes [(pid, bytes)], ecc (uncorrected count or None when
unsupported), retired_pending, remap (corrected, uncorrected, pending, failed) or None when unsupported.
Error classes and constants carry the values of the real module.
"""

from __future__ import annotations

import types

GB = 10**9


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found"}.get(
            self.value, "Unknown Error"
        )


def gpu(i: int, used: float = 120, total: float = 141, **kw) -> dict:
    return {
        "name": "NVIDIA H200",
        "uuid": f"GPU-{i:08x}-fake",
        "total": int(total * GB),
        "used": int(used * GB),
        "util": 90,
        "processes": [],
        "ecc": 0,
        "retired_pending": False,
        "remap": (0, 0, 0, 0),
        **kw,
    }


def fake_pynvml(gpus: list[dict] | None = None, init_error: int | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC, m.NVML_FEATURE_ENABLED = 1, 0, 1
    m.calls = []
    gpus = gpus or []

    def init():
        m.calls.append("init")
        if init_error is not None:
            raise NVMLError(init_error)

    def unsupported_if_none(value):
        if value is None:
            raise NVMLError(3)
        return value

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetName = lambda h: h["name"]
    m.nvmlDeviceGetUUID = lambda h: h["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=h["total"], used=h["used"], free=h["total"] - h["used"]
    )
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=h["util"], memory=0)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in h["processes"]
    ]
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: unsupported_if_none(h["ecc"])
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: int(bool(h["retired_pending"]))
    m.nvmlDeviceGetRemappedRows = lambda h: unsupported_if_none(h["remap"])
    return m

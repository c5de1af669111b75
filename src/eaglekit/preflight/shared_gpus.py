"""The vLLM feature servers and the trainer on the same GPUs (``extract.mode: stream`` with
``extract.vllm.shares_trainer_gpus``): does each GPU hold both?

A vLLM server takes ``gpu_memory_utilization`` × a GPU's total memory on every GPU it runs on — weights, activations
and a KV cache sized to fill the rest of that share, whatever the requests need — and refuses to start where less
is free. The trainer's step takes the drafter's step memory (``training/memory.py``: the model train's pre-flight
and ``plan`` use). On a shared GPU the two add up against the GPU's total: ``plan`` prints the sum per GPU, train's
pre-flight refuses the run where it does not fit and names what would (the utilization that leaves the step its
room, activation checkpointing, fewer tokens a micro-batch, or GPUs of their own for the servers).
"""

from __future__ import annotations

import math

from eaglekit.config import RunConfig
from eaglekit.preflight import CheckResult, fail, ok, skip
from eaglekit.preflight.gpus import GPU, visible
from eaglekit.progress import human_bytes
from eaglekit.training.memory import StepMemory

VLLM_DEFAULT_UTILIZATION = (
    0.92  # vLLM's --gpu-memory-utilization when the flag is not given (vllm/config/cache.py, 0.32)
)
NAME = "servers beside the trainer"


def shares_trainer_gpus(cfg: RunConfig) -> bool:
    return cfg.extract.streamed and cfg.extract.vllm is not None and cfg.extract.vllm.shares_trainer_gpus


def utilization(cfg: RunConfig) -> tuple[float, str]:
    """The share of each GPU a server takes, and where that figure comes from."""
    v = cfg.extract.vllm
    if v is not None and v.gpu_memory_utilization is not None:
        return v.gpu_memory_utilization, "extract.vllm.gpu_memory_utilization"
    return VLLM_DEFAULT_UTILIZATION, "vLLM's default: extract.vllm.gpu_memory_utilization is unset"


def utilization_leaving(step: int, total: int) -> float:
    """The largest utilization (two decimals, as vLLM's flag is usually written) that leaves ``step`` bytes free."""
    return math.floor((total - step) / total * 100) / 100


def smallest_gpu_for(step: int, share: float) -> float:
    """The GPU memory at which ``share`` of it and a step of ``step`` bytes just fit."""
    return step / (1 - share)


def gpu_line(gpus: list[GPU], share: float, step: int) -> str:
    """The sum on GPUs of one size: the servers' share and the step against their memory."""
    total = gpus[0].total
    servers = share * total
    verdict = "fits" if servers + step <= total else "does not fit"
    names = f"GPU {gpus[0].index}" if len(gpus) == 1 else f"GPUs {', '.join(str(g.index) for g in gpus)}"
    each = " each" if len(gpus) > 1 else ""
    return (
        f"{names} ({human_bytes(total)}{each}): the servers {share:g} × {human_bytes(total)} = {human_bytes(servers)} "
        f"+ the drafter's step {human_bytes(step)} = {human_bytes(servers + step)}: {verdict}"
    )


def plan_lines(cfg: RunConfig, step: int, found: list[GPU] | str) -> list[str]:
    """What `plan` prints for the shared GPUs: the sum on each GPU this process sees, or without one the smallest
    GPU that holds both."""
    share, source = utilization(cfg)
    lines = [f"servers and trainer share the GPUs (extract.vllm.shares_trainer_gpus): the servers {share:g} ({source})"]
    used = visible(found) if isinstance(found, list) else []
    if used:
        sizes = sorted({g.total for g in used})
        lines += [f"  {gpu_line([g for g in used if g.total == size], share, step)}" for size in sizes]
    else:
        why = found if isinstance(found, str) else "no GPU visible to this process"
        lines.append(
            f"  {why}: both fit a GPU of {human_bytes(smallest_gpu_for(step, share))} or more (the step "
            f"{human_bytes(step)} ÷ (1 − {share:g}))"
        )
    return lines


def check(cfg: RunConfig, step: tuple[StepMemory, StepMemory] | None, found: list[GPU] | str) -> CheckResult:
    """Each GPU this process sees holds the servers' share and the drafter's step; refused with the remedies."""
    if isinstance(found, str):
        return skip(NAME, f"no GPU: not checked ({found}); `eaglekit plan` gives the GPU memory both need")
    used = visible(found)
    if not used:
        return skip(NAME, "no GPU visible to this process (CUDA_VISIBLE_DEVICES)")
    if step is None:
        return skip(NAME, "the drafter's step memory is not modelled for a finetune (train.init_from)")
    plain, recomputed = step
    checkpointed = cfg.train.ttt.activation_checkpointing
    need = (recomputed if checkpointed else plain).total
    share, source = utilization(cfg)
    smallest = min(used, key=lambda g: g.total)
    of = f" (the smallest of {len(used)} GPUs)" if len(used) > 1 else ""
    detail = f"{gpu_line([smallest], share, need)}{of}; the servers' share: {source}"
    if share * smallest.total + need <= smallest.total:
        return ok(NAME, detail)
    remedies = []
    lower = utilization_leaving(need, smallest.total)
    if lower > 0:
        remedies.append(
            f"extract.vllm.gpu_memory_utilization: {lower:g} (restart the servers with `eaglekit serve-command`'s "
            f"--gpu-memory-utilization {lower:g}; the target's weights on each GPU and a KV cache must fit in "
            f"{human_bytes(lower * smallest.total)})"
        )
    if not checkpointed and share * smallest.total + recomputed.total <= smallest.total:
        remedies.append(f"train.ttt.activation_checkpointing: true (a step of {human_bytes(recomputed.total)})")
    remedies.append("fewer tokens a micro-batch (train.batch_size, prepare.max_length or train.pack_length)")
    remedies.append(
        "the servers on GPUs or nodes of their own (extract.vllm.shares_trainer_gpus: false; see "
        "docs/features.md: 'Placement')"
    )
    return fail(NAME, detail, "; or ".join(remedies))

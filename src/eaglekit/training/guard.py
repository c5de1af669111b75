"""The non-finite guard of the training loop: a step whose loss or gradient norm is NaN or Inf stops training before
the optimizer applies it, and an update that leaves a weight non-finite stops it before anything is saved, so the
latest checkpoint stays the last finite one and a rerun resumes from it.

Every rank decides alike (a flag summed over ranks): under DDP a rank's loss is its own, and under FSDP so is its
shard of the weights; a rank that stopped alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from eaglekit.errors import EaglekitError
from eaglekit.training import distributed as dist
from eaglekit.training.metrics import reduce_device
from eaglekit.training.step_checkpoints import Checkpoints


class NonFiniteTraining(EaglekitError):
    """Training diverged: a loss, gradient norm or weight became NaN or Inf."""


def _any_rank(flags: list[bool]) -> list[bool]:
    t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=reduce_device())
    dist.all_reduce_sum(t)
    return [v > 0 for v in t.tolist()]


def _latest(ckpts: Checkpoints) -> str | None:
    try:
        latest = ckpts.latest()
    except EaglekitError:  # a damaged pointer: its own error is for the rerun to say
        return None
    return latest.name if latest else None


def _stop(step: int, what: str, lr: float, ckpts: Checkpoints) -> NonFiniteTraining:
    latest = _latest(ckpts)
    kept = f"checkpoint {latest} stays the resume point" if latest else "no checkpoint was written yet"
    again = f"rerun the same command to resume from {latest}" if latest else "rerun the same command"
    return NonFiniteTraining(
        f"train: step {step}: {what} (lr {lr:.3g} at this step); nothing of this step was saved; {kept}",
        f"lower train.lr (a new lr is a new run: add --force) or raise train.warmup_steps, and check the data for "
        f"extreme samples; if it came from a passing fault, {again}",
    )


def refuse_non_finite_step(step: int, loss: float, grad_norm: float, lr: float, ckpts: Checkpoints) -> None:
    """Raise before step ``step`` (1-based, as logged) is applied when any rank's loss or the gradient norm is not
    finite."""
    bad_loss, bad_grad = _any_rank([not math.isfinite(loss), not math.isfinite(grad_norm)])
    if bad_loss:
        value = f"{loss}" if not math.isfinite(loss) else "not finite on another rank"
        raise _stop(step, f"the loss is {value}: stopped before the optimizer applied it", lr, ckpts)
    if bad_grad:
        raise _stop(step, f"the gradient norm is {grad_norm}: stopped before the optimizer applied it", lr, ckpts)


def refuse_non_finite_weights(step: int, named_params: Sequence[tuple[str, torch.Tensor]], lr: float,
                              ckpts: Checkpoints) -> None:  # fmt: skip
    """Raise after step ``step``'s update when it left any weight NaN or Inf (a finite gradient times a huge lr
    overflows), before a checkpoint or best/ could save it."""
    if not named_params:
        return
    sharded = any(hasattr(p, "to_local") for _, p in named_params)  # FSDP: each rank holds a shard
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named_params]
    counts = torch.stack([(~torch.isfinite(p.detach())).sum() for p in local]).to(reduce_device(), torch.float64)
    if sharded:  # DDP's replicas are equal: every rank decides alike without a collective
        dist.all_reduce_sum(counts)
    bad = [(name, int(n)) for (name, _), n in zip(named_params, counts.tolist(), strict=True) if n]
    if bad:
        listed = ", ".join(f"{name.removeprefix('module.')} ({n:,} values)" for name, n in bad[:3])
        more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
        raise _stop(step, f"the update left non-finite weights: {listed}{more}", lr, ckpts)

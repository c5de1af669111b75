"""The draft head and the loss of TTT, fused so no [N, Vd] tensor is kept for backward.

Every TTT step ends in ``lm_head`` over the draft vocabulary and a soft cross-entropy against the
target's distribution. Written plainly (``F.cross_entropy(lm_head(x), target_p)``) autograd keeps two
[N, Vd] fp32 tensors per step for backward — the log-softmax and the gathered target probabilities:
64 KiB per token per step at Vd = 8192, 250 KiB at Vd = 32000, most of what a TTT step costs in memory.

The loss is a scalar and its gradient needs nothing from backward but one number, so this function
does what fused linear-cross-entropy kernels do (Liger's ``FusedLinearCrossEntropy``): it walks the rows
in chunks, and for each chunk computes the logits, the loss, the argmax, and at once the gradients
with respect to x and to the head's weight. Backward only scales those by the incoming gradient. Kept
for backward: dL/dx [N, H] and dL/dW [Vd, H] — no more matmuls than the plain version (the logits'
forward, dx and dW), and only one chunk of logits alive at a time.

The loss itself is one of the divergences of ``eaglekit/divergences.py`` (``train.ttt.loss``; default forward KL, whose
value is reported as the soft cross-entropy): each supplies its rows' value and dL/dlogits per chunk.

All TTT steps go through one call (their rows concatenated, each row weighted by decay^k / count_k),
so dL/dW exists once, not once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglekit.divergences import DEFAULT_DIVERGENCE, Divergence

# Rows per chunk: at most this many logits at once (4 Mi elements = 16 MiB in fp32). Larger chunks make the
# transient memory of a step depend on how many rows the step has; on a GPU the matmuls want more rows.
CHUNK_ELEMENTS = {"cpu": 1 << 22}
CHUNK_ELEMENTS_DEFAULT = 1 << 25

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class HeadTargets:
    """What each row of the head is scored against: the target's distributions and where each row finds its own."""

    p: torch.Tensor  # [P, Vd] the target's probabilities over the draft vocabulary (rows sum to 1)
    argmax: torch.Tensor  # [P] the target's argmax
    slots: torch.Tensor  # [M] the target row of each head row
    row_weight: torch.Tensor  # [M] each head row's weight in the summed loss


@dataclass(frozen=True)
class _Pass:
    """How _HeadLoss walks the rows: matmul dtype, chunk size, which gradients, the loss and its chunk function."""

    matmul_dtype: torch.dtype
    chunk_rows: int
    need_dx: bool
    need_dw: bool
    loss: Divergence
    chunk_fn: ChunkFn


@dataclass
class HeadLoss:
    loss: torch.Tensor  # scalar: sum over rows of row_weight * the row's loss (differentiable)
    value: torch.Tensor  # [M] each row's loss (no grad): the soft cross-entropy for kl_div
    correct: torch.Tensor  # [M] bool: the draft's argmax equals the target's

    @property
    def ce(self) -> torch.Tensor:
        """The rows' loss under its historical name (it is the soft cross-entropy for the default loss)."""
        return self.value


def head_soft_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: HeadTargets,
    loss: Divergence = DEFAULT_DIVERGENCE,
    chunk_fn: ChunkFn | None = None,
    chunk_rows: int | None = None,
) -> HeadLoss:
    """Σ_m row_weight[m] · L(p[slots[m]], softmax(x[m] @ weight.T)), without [M, Vd] kept for backward.

    L is the divergence ``loss`` (``eaglekit/divergences.py``; default the soft cross-entropy H(p, q)).

    x [M, H] the normed draft hidden states; weight [Vd, H] the draft head; ``targets`` what each row is scored
    against (``HeadTargets``). ``chunk_fn`` computes one chunk (default ``head_loss_chunk``; the GPU path passes
    it compiled). The matmuls run in the autocast dtype when autocast is on (as ``lm_head`` would),
    softmax and loss in float32 (float64 for float64 inputs).
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        matmul_dtype = torch.get_autocast_dtype(device_type)
    else:
        matmul_dtype = torch.promote_types(x.dtype, weight.dtype)
    if chunk_rows is None:
        elements = CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS_DEFAULT)
        chunk_rows = max(1, elements // max(1, weight.shape[0]))
    grad = torch.is_grad_enabled()
    walk = _Pass(
        matmul_dtype,
        chunk_rows,
        need_dx=grad and x.requires_grad,
        need_dw=grad and weight.requires_grad,
        loss=loss,
        chunk_fn=chunk_fn or head_loss_chunk,
    )
    total, value, correct = _HeadLoss.apply(x, weight, targets, walk)
    return HeadLoss(loss=total, value=value, correct=correct)


def head_loss_chunk(
    xc: torch.Tensor,
    w_mm: torch.Tensor,
    target_p: torch.Tensor,
    target_argmax: torch.Tensor,
    slots: torch.Tensor,
    row_weight: torch.Tensor,
    need_grad: bool,
    loss: Divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of rows: (each row's loss [c], argmax hit [c], dL/dlogits [c, Vd] in xc's dtype or None).

    Its own function so that a GPU can run it compiled (``training/fused.py``: the elementwise work over the
    [c, Vd] logits fused into few kernels) with the very same math, whichever divergence ``loss`` is.
    ``row_weight`` is in the compute dtype.
    """
    logits = (xc @ w_mm.T).to(row_weight.dtype)  # [c, Vd], the only chunk of logits alive
    correct = logits.argmax(-1) == target_argmax[slots]
    p = target_p[slots].to(row_weight.dtype)
    value, dz = loss.rows(logits, p, need_grad=need_grad)
    if dz is None:
        return value, correct, None
    return value, correct, dz.mul_(row_weight[:, None]).to(xc.dtype)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets: HeadTargets, walk: _Pass):
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        m = x.shape[0]
        w_mm = weight.to(walk.matmul_dtype)
        value = torch.empty(m, dtype=compute, device=x.device)
        correct = torch.empty(m, dtype=torch.bool, device=x.device)
        dx = torch.empty_like(x) if walk.need_dx else None
        dw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if walk.need_dw else None
        row_weight = targets.row_weight.to(compute)
        for r0 in range(0, m, walk.chunk_rows):
            r1 = min(r0 + walk.chunk_rows, m)
            xc = x[r0:r1].to(walk.matmul_dtype)
            value[r0:r1], correct[r0:r1], dz = walk.chunk_fn(
                xc,
                w_mm,
                targets.p,
                targets.argmax,
                targets.slots[r0:r1],
                row_weight[r0:r1],
                walk.need_dx or walk.need_dw,
                walk.loss,
            )
            if dz is not None:
                if dx is not None:
                    dx[r0:r1] = (dz @ w_mm).to(x.dtype)
                if dw is not None:
                    dw += (dz.T @ xc).to(dw.dtype)
            del dz
        loss = (value * row_weight).sum()
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(value, correct)
        return loss, value, correct

    @staticmethod
    def backward(ctx, d_loss, _d_value, _d_correct):
        dx, dw = ctx.saved_tensors
        grad_x = None if dx is None else dx * d_loss.to(dx.dtype)
        grad_w = None if dw is None else (dw * d_loss.to(dw.dtype)).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None

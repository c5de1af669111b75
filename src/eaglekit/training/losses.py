"""The divergences TTT can train on (``train.loss``): each row's value and its gradient with respect to the logits.

One plain function per chunk of rows, ``divergence(kind, logits, p)``, so the fused head in ``training/loss.py`` can
form gradients in forward without keeping [N, Vd] for backward, and a compiled or CUDA version can wrap exactly this
maths. For a loss of q = softmax(z) with g = ∂L/∂q the chain rule through the softmax gives

    dL/dz = q ⊙ (g − ⟨q, g⟩)

and every branch below is that formula with its own g, written in closed form. p is the target's distribution over
the draft vocabulary (rows sum to 1; entries may underflow to 0).

The kinds and their names follow speculators' loss zoo (``speculators.losses``), so a race can name the same loss on
both sides:

- ``kl_div``: forward KL(p ‖ q), the EAGLE objective. The value reported is the soft cross-entropy H(p, q) = KL + H(p)
  (what eaglekit always logged; H(p) does not depend on the drafter, so the gradient is KL's: q·Σp − p).
- ``rkl``: reverse KL(q ‖ p), mode-seeking.
- ``jsd``: Jensen–Shannon, ½ KL(p ‖ m) + ½ KL(q ‖ m) with m = (p + q) / 2; bounded by log 2.
- ``tv``: total variation 1 − α with α = Σ min(p, q), the acceptance rate of speculative sampling at this position.
  Sub-gradient: ∂L/∂q_v = −1 where q_v ≤ p_v (speculators' and Liger's convention at ties).
- ``nla``: the LK loss −log α (Samarin et al., arXiv 2602.23881): TV's gradient scaled by 1/α, large while the
  overlap is small. α is clamped at ``NLA_EPS`` as in speculators; below it the gradient is 0 (clamp's gradient).
- ``lk_hybrid``: the paper's hybrid λ·KL(p ‖ q) + (1 − λ)·TV with λ = exp(−η·sg(α)): KL's strong gradient while the
  draft is far off, TV (acceptance itself) as it closes in. η = ``train.lk_eta`` (3.0, the paper's best).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Divergence = Literal["kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid"]
DIVERGENCES: tuple[str, ...] = ("kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid")
NLA_EPS = 1e-5  # speculators' clamp of the overlap inside −log α


def divergence(
    kind: str, logits: torch.Tensor, p: torch.Tensor, lk_eta: float = 3.0, need_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's loss [c] and dL/dlogits [c, Vd] (None when ``need_grad`` is false) for logits [c, Vd], p [c, Vd].

    Runs in the dtype of ``logits`` (the caller upcasts to float32 or float64). ``logits`` is not modified.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    log_q = logits - lse
    q = log_q.exp()
    if kind == "kl_div":
        p_sum = p.sum(-1)
        value = lse[:, 0] * p_sum - (p * logits).sum(-1)
        return value, (q * p_sum[:, None] - p) if need_grad else None
    if kind == "rkl":
        log_p = _log(p)
        ratio = log_q - log_p
        value = (q * ratio).sum(-1)
        # g = log q − log p + 1; the constant drops out of g − ⟨q, g⟩
        return value, (q * (ratio - value[:, None])) if need_grad else None
    if kind == "jsd":
        log_p = _log(p)
        log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
        kl_qm = (q * (log_q - log_m)).sum(-1)
        kl_pm = torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1)
        value = 0.5 * (kl_pm + kl_qm)
        # g = ½ log(q / m): the p/(2m) and q/(2m) terms of the two KLs cancel against the +½
        return value, (0.5 * q * (log_q - log_m - kl_qm[:, None])) if need_grad else None
    if kind not in ("tv", "nla", "lk_hybrid"):
        raise ValueError(f"unknown divergence {kind!r}; expected one of {', '.join(DIVERGENCES)}")
    below = q <= p
    alpha = torch.minimum(p, q).sum(-1)
    # g = −1[q ≤ p]  ⇒  dTV/dz = −q ⊙ (1[q ≤ p] − s), s = Σ_{q ≤ p} q
    d_tv = None
    if need_grad:
        s = torch.where(below, q, 0.0).sum(-1, keepdim=True)
        d_tv = -q * (below.to(q.dtype) - s)
    if kind == "tv":
        return 1.0 - alpha, d_tv
    if kind == "nla":
        clamped = alpha.clamp_min(NLA_EPS)
        scale = torch.where(alpha > NLA_EPS, -1.0 / clamped, 0.0)  # d(−log α)/dα, 0 where the clamp holds
        # d_tv is −dα/dz
        return -torch.log(clamped), (-scale[:, None] * d_tv) if d_tv is not None else None
    lam = torch.exp(-lk_eta * alpha)
    kl = (torch.where(p > 0, p * _log(p), 0.0) - p * log_q).sum(-1)
    value = lam * kl + (1.0 - lam) * (1.0 - alpha)
    if d_tv is None:
        return value, None
    return value, lam[:, None] * (q * p.sum(-1, keepdim=True) - p) + (1.0 - lam)[:, None] * d_tv


def _log(p: torch.Tensor) -> torch.Tensor:
    """log p with log 0 = −inf kept finite where multiplied by 0 (callers mask p = 0 or weight by q)."""
    return torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))

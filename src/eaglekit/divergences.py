"""The divergences TTT can train on (``train.ttt.loss``): named objects, each with its own parameters, that give each
row's value and its gradient with respect to the logits.

A divergence is one class here, registered by name; the config's ``train.ttt.loss`` accepts exactly the registered
names (``LossChoice``), with each one's parameters as its keys (``{name: lk_hybrid, eta: 3.0}``, or the bare name for
the defaults). Adding one is a class and ``@register`` in this file. It sits in the bottom layer because the config
reads it, and so it does not import torch (a second of every start, ``eaglekit --help`` and a config load included):
the maths below are tensor methods, and torch itself is imported only where a tensor has no method for it. The fused
head (``training/head_loss.py``) calls ``rows`` per chunk of rows, so it can form gradients in forward
without keeping [N, Vd] for backward, and a compiled or CUDA version can wrap exactly this maths.

For a loss of q = softmax(z) with g = ∂L/∂q the chain rule through the softmax gives

    dL/dz = q ⊙ (g − ⟨q, g⟩)

and every ``rows`` below is that formula with its own g, written in closed form. p is the target's distribution over
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
  draft is far off, TV (acceptance itself) as it closes in. η = its ``eta`` (3.0, the paper's best).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

    Rows = tuple[torch.Tensor, torch.Tensor | None]

NLA_EPS = 1e-5  # speculators' clamp of the overlap inside −log α


class Divergence(BaseModel):
    """A divergence between the target's p and the draft's q = softmax(logits), row by row. Its fields are its
    parameters (``train.ttt.loss``'s keys); frozen, so one object can be handed to a compiled chunk function."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    summary: ClassVar[str]  # what it is, in the config reference's words

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        """Each row's loss [c] and dL/dlogits [c, Vd] (None when ``need_grad`` is false) for logits [c, Vd], p [c, Vd].

        Runs in the dtype of ``logits`` (the caller upcasts to float32 or float64). ``logits`` is not modified.
        """
        raise NotImplementedError

    @model_validator(mode="before")
    @classmethod
    def _parameters_of_its_own(cls, data: Any) -> Any:
        # a parameter of another divergence (eta with kl_div) would do nothing: name its owner
        if isinstance(data, dict):
            stray = sorted(set(data) - set(cls.model_fields))
            if stray:
                owners = {key: [n for n, d in DIVERGENCES.items() if key in d.model_fields] for key in stray}
                listed = "; ".join(f"{key} ({', '.join(owners[key]) or 'no divergence'})" for key in stray)
                takes = ", ".join(k for k in cls.model_fields if k != "name") or "no parameters"
                raise ValueError(f"loss {data.get('name')} does not read {listed}: it takes {takes}")
        return data


DIVERGENCES: dict[str, type[Divergence]] = {}


def register(cls: type[Divergence]) -> type[Divergence]:
    """Adds a divergence to the table the config and the training step choose from, under its ``name``."""
    DIVERGENCES[cls.model_fields["name"].default] = cls
    return cls


def _log(p: torch.Tensor) -> torch.Tensor:
    """log p with log 0 = −inf kept finite where multiplied by 0 (callers mask p = 0 or weight by q)."""
    import torch  # lazy: heavy (torch: the config imports this module, and a config load must not pay for torch)

    return p.clamp_min(torch.finfo(p.dtype).tiny).log()


def _softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [c, 1], log q, q) of each row."""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    log_q = logits - lse
    return lse, log_q, log_q.exp()


def _overlap(q: torch.Tensor, p: torch.Tensor, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """α = Σ min(p, q), each row's acceptance rate, and −dα/dz (TV's gradient; None without ``need_grad``)."""
    below = q <= p
    alpha = p.minimum(q).sum(-1)
    # g = −1[q ≤ p]  ⇒  dTV/dz = −q ⊙ (1[q ≤ p] − s), s = Σ_{q ≤ p} q
    if not need_grad:
        return alpha, None
    s = q.where(below, 0.0).sum(-1, keepdim=True)
    return alpha, -q * (below.to(q.dtype) - s)


@register
class KLDiv(Divergence):
    name: Literal["kl_div"] = "kl_div"
    summary: ClassVar[str] = "forward KL (EAGLE's; logged as soft cross-entropy)"

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        lse, _, q = _softmax(logits)
        p_sum = p.sum(-1)
        value = lse[:, 0] * p_sum - (p * logits).sum(-1)
        return value, (q * p_sum[:, None] - p) if need_grad else None


@register
class ReverseKL(Divergence):
    name: Literal["rkl"] = "rkl"
    summary: ClassVar[str] = "reverse KL"

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        _, log_q, q = _softmax(logits)
        ratio = log_q - _log(p)
        value = (q * ratio).sum(-1)
        # g = log q − log p + 1; the constant drops out of g − ⟨q, g⟩
        return value, (q * (ratio - value[:, None])) if need_grad else None


@register
class JensenShannon(Divergence):
    name: Literal["jsd"] = "jsd"
    summary: ClassVar[str] = "Jensen-Shannon"

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        _, log_q, q = _softmax(logits)
        log_p = _log(p)
        log_m = log_q.logaddexp(log_p) - math.log(2.0)
        kl_qm = (q * (log_q - log_m)).sum(-1)
        kl_pm = (p * (log_p - log_m)).where(p > 0, 0.0).sum(-1)
        value = 0.5 * (kl_pm + kl_qm)
        # g = ½ log(q / m): the p/(2m) and q/(2m) terms of the two KLs cancel against the +½
        return value, (0.5 * q * (log_q - log_m - kl_qm[:, None])) if need_grad else None


@register
class TotalVariation(Divergence):
    name: Literal["tv"] = "tv"
    summary: ClassVar[str] = "total variation (1 - acceptance rate)"

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        _, _, q = _softmax(logits)
        alpha, d_tv = _overlap(q, p, need_grad)
        return 1.0 - alpha, d_tv


@register
class NegativeLogAcceptance(Divergence):
    name: Literal["nla"] = "nla"
    summary: ClassVar[str] = "-log(acceptance rate), the LK loss of arXiv 2602.23881"

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        _, _, q = _softmax(logits)
        alpha, d_tv = _overlap(q, p, need_grad)
        clamped = alpha.clamp_min(NLA_EPS)
        scale = (-1.0 / clamped).where(alpha > NLA_EPS, 0.0)  # d(−log α)/dα, 0 where the clamp holds
        # d_tv is −dα/dz
        return -clamped.log(), (-scale[:, None] * d_tv) if d_tv is not None else None


@register
class LKHybrid(Divergence):
    name: Literal["lk_hybrid"] = "lk_hybrid"
    summary: ClassVar[str] = "lambda·KL + (1 - lambda)·TV with lambda = exp(-eta·acceptance), arXiv 2602.23881's hybrid"
    eta: float = Field(3.0, gt=0.0, description="weight exp(-eta * acceptance) on KL, the rest on TV (the paper's 3.0)")

    def rows(self, logits: torch.Tensor, p: torch.Tensor, need_grad: bool = True) -> Rows:
        _, log_q, q = _softmax(logits)
        alpha, d_tv = _overlap(q, p, need_grad)
        lam = (-self.eta * alpha).exp()
        kl = ((p * _log(p)).where(p > 0, 0.0) - p * log_q).sum(-1)
        value = lam * kl + (1.0 - lam) * (1.0 - alpha)
        if d_tv is None:
            return value, None
        return value, lam[:, None] * (q * p.sum(-1, keepdim=True) - p) + (1.0 - lam)[:, None] * d_tv


DEFAULT_DIVERGENCE = KLDiv()  # EAGLE's, and train.ttt.loss's default


def _by_name(value: Any) -> Any:
    # `loss: jsd` is the common case: a bare name is that divergence with its defaults; a mapping without a name is
    # the default divergence's
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and "name" not in value:
        return {"name": DEFAULT_DIVERGENCE.name, **value}
    return value


# What the config's train.ttt.loss holds: one of the registered divergences, chosen by ``name``.
if TYPE_CHECKING:
    LossChoice = Divergence
else:
    LossChoice = Annotated[
        Union[tuple(DIVERGENCES.values())],  # noqa: UP007 (a Union built from the table)
        Field(discriminator="name"),
        BeforeValidator(_by_name),
    ]


def loss_reference() -> str:
    """The divergences and their parameters, as the config's description of train.ttt.loss lists them."""
    parts = []
    for name, cls in DIVERGENCES.items():
        params = [f"{key} {field.default}" for key, field in cls.model_fields.items() if key != "name"]
        parts.append(f"{name}: {cls.summary}" + (f" ({', '.join(params)})" if params else ""))
    return "; ".join(parts)

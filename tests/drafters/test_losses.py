"""The divergences of train.ttt.loss: each row's value and dL/dlogits against a direct fp64 implementation with
autograd, and the registry they are chosen from.

The references are written as the definitions read (speculators' eager loss zoo, the LK paper), through softmax
and autograd, so the closed-form gradients of eaglekit/divergences.py and the fused head of training/head_loss.py are
checked against maths they do not share.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eaglekit.config import TTTConfig, parse_config
from eaglekit.divergences import DIVERGENCES, Divergence, LKHybrid
from eaglekit.drafters.eagle3.head_loss import HeadTargets, head_soft_cross_entropy
from eaglekit.errors import UsageError


def divergence(kind: str, logits: torch.Tensor, p: torch.Tensor, **params):
    """The registered divergence ``kind`` with ``params``, over logits and p."""
    return DIVERGENCES[kind](**params).rows(logits, p)


def reference(kind: str, logits: torch.Tensor, p: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """Each row's loss, plainly: q = softmax(logits), p given."""
    log_q = F.log_softmax(logits, -1)
    q = log_q.exp()
    log_p = torch.log(p)
    kl_pq = (p * (log_p - log_q)).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "kl_div":
        return -(p * log_q).sum(-1)  # reported as the soft cross-entropy; KL + H(p)
    if kind == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        m = (p + q) / 2
        return 0.5 * (p * (log_p - m.log())).sum(-1) + 0.5 * (q * (log_q - m.log())).sum(-1)
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "nla":
        return -torch.log(alpha)
    if kind == "lk_hybrid":
        lam = torch.exp(-eta * alpha.detach())
        return lam * kl_pq + (1 - lam) * (1 - alpha)
    raise AssertionError(kind)


def rows(n: int = 6, vocab: int = 40, seed: int = 0, sharp: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * sharp, -1)
    return logits, p


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_value_and_gradient_match_autograd(kind):
    logits, p = rows()
    z = logits.clone().requires_grad_(True)
    want = reference(kind, z, p, eta=2.5)
    (want_grad,) = torch.autograd.grad(want.sum(), z)
    value, grad = divergence(kind, logits.clone(), p, **({"eta": 2.5} if kind == "lk_hybrid" else {}))
    torch.testing.assert_close(value, want.detach(), rtol=1e-10, atol=1e-12)
    assert grad is not None
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)


def test_known_values():
    # q = p: every divergence is 0 and acceptance is 1 (kl_div reports H(p)); the smooth ones have no gradient
    # there (TV's family sits on its kink, where rounding picks a sub-gradient); disjoint supports: TV = 1
    logits, p = rows()
    same = torch.log(p)
    for kind in ("rkl", "jsd", "tv", "nla", "lk_hybrid"):
        value, grad = divergence(kind, same, p)
        torch.testing.assert_close(value, torch.zeros_like(value), atol=1e-12, rtol=0)
        assert grad is not None
        if kind in ("rkl", "jsd"):
            assert grad.abs().max() < 1e-9
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(divergence("kl_div", same, p)[0], entropy)
    z = torch.tensor([[30.0, -30.0]], dtype=torch.float64)
    target = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    assert divergence("tv", z, target)[0].item() == pytest.approx(1.0, abs=1e-12)
    assert divergence("jsd", z, target)[0].item() == pytest.approx(math.log(2), abs=1e-12)


def test_zero_target_probabilities_stay_finite():
    # the target's softmax underflows to 0 on most of a real vocabulary
    logits, p = rows(sharp=60.0)
    p = torch.where(p < 1e-30, 0.0, p)
    p = p / p.sum(-1, keepdim=True)
    assert (p == 0).any()
    for kind in DIVERGENCES:
        value, grad = divergence(kind, logits, p)
        assert torch.isfinite(value).all() and grad is not None and torch.isfinite(grad).all(), kind


def test_nla_below_the_clamp_has_no_gradient():
    z = torch.tensor([[40.0, -40.0, -40.0]], dtype=torch.float64)
    target = torch.tensor([[0.0, 0.5, 0.5]], dtype=torch.float64)
    value, grad = divergence("nla", z, target)
    assert value.item() == pytest.approx(-math.log(1e-5))
    assert grad is not None and grad.abs().max().item() == 0.0


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_fused_head_matches_unfused_autograd(kind, chunk_rows):
    # the head + loss as one chunked function: x @ W.T, each row's loss weighted, summed
    g = torch.Generator().manual_seed(1)
    m, hidden, vocab, targets = 7, 12, 30, 5
    x = torch.randn(m, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    target_p = torch.softmax(torch.randn(targets, vocab, generator=g, dtype=torch.float64) * 2, -1)
    slots = torch.randint(0, targets, (m,), generator=g)
    row_weight = torch.rand(m, generator=g, dtype=torch.float64)

    logits = x @ weight.T
    per_row = reference(kind, logits, target_p[slots])
    want = (per_row * row_weight).sum()
    want_dx, want_dw = torch.autograd.grad(want, (x, weight))

    targets = HeadTargets(target_p, target_p.argmax(-1), slots, row_weight)
    fused = head_soft_cross_entropy(x, weight, targets, DIVERGENCES[kind](), chunk_rows=chunk_rows)
    dx, dw = torch.autograd.grad(fused.loss, (x, weight))
    torch.testing.assert_close(fused.loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused.value, per_row.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx, want_dx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dw, want_dw, rtol=1e-9, atol=1e-12)
    assert torch.equal(fused.correct, logits.argmax(-1) == target_p.argmax(-1)[slots])


# ------------------------------------------------------------------------------------------------ the registry


def test_the_configs_loss_names_are_the_registrys():
    """train.ttt.loss accepts each registered name (bare, or as a mapping with its parameters) and nothing else; the
    refusal lists the registry's names, so a divergence added to it is a config choice without touching config.py."""
    for name, cls in DIVERGENCES.items():
        assert type(TTTConfig(loss=name).loss) is cls
        assert type(TTTConfig(loss={"name": name}).loss) is cls
    with pytest.raises(UsageError) as err:
        parse_config({**BASE, "train": {"ttt": {"loss": "l2"}}})
    (line,) = [line for line in err.value.message.splitlines() if "train.ttt.loss" in line]
    assert "'l2'" in line and all(f"'{name}'" in line for name in DIVERGENCES), line
    assert set(DIVERGENCES) == {"kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid"}  # speculators' loss zoo's names
    assert all(name in TTTConfig.model_fields["loss"].description for name in DIVERGENCES)


BASE = {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}}


def test_a_loss_parameter_belongs_to_its_loss():
    """lk_hybrid owns eta: it is set there, written back there, and beside another loss it is refused at load,
    naming the key and its owner (the flat train.lk_eta was silently ignored with any other loss)."""
    cfg = parse_config({**BASE, "train": {"ttt": {"loss": {"name": "lk_hybrid", "eta": 2.5}}}})
    assert cfg.train.ttt.loss == LKHybrid(eta=2.5)
    assert cfg.train.ttt.model_dump()["loss"] == {"name": "lk_hybrid", "eta": 2.5}  # so it is in train's fingerprint
    assert TTTConfig(loss="lk_hybrid").loss == LKHybrid(eta=3.0)  # the bare name: the paper's 3.0
    for train in ({"ttt": {"loss": {"name": "kl_div", "eta": 2.5}}}, {"ttt": {"loss": {"eta": 2.5}}}):
        with pytest.raises(UsageError, match=r"loss kl_div does not read eta \(lk_hybrid\)"):
            parse_config({**BASE, "train": train})
    with pytest.raises(UsageError, match=r"does not read eta \(lk_hybrid\)"), pytest.warns(FutureWarning):
        parse_config({**BASE, "train": {"loss": "jsd", "lk_eta": 2.5}})  # the old flat spelling, same rule
    with pytest.raises(UsageError, match="eta'.*greater than 0"):
        parse_config({**BASE, "train": {"ttt": {"loss": {"name": "lk_hybrid", "eta": 0}}}})


def test_a_loss_is_one_frozen_object_a_compiled_chunk_can_take():
    loss = TTTConfig(loss={"name": "lk_hybrid", "eta": 1.5}).loss
    assert isinstance(loss, Divergence) and hash(loss) == hash(LKHybrid(eta=1.5))
    with pytest.raises(Exception, match="frozen"):
        loss.eta = 2.0  # type: ignore[misc]

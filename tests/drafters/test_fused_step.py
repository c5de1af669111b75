"""The fused GPU path of the TTT step (training/attention.py, training/fused.py) against ttt.py's reference.

Flex attention has no backward on the CPU, and its fused kernels exist only compiled on a GPU; here its mask
(``span_mask``, the one definition of which keys a row sees) and key layout (``span_keys``) run through a dense
SDPA stand-in with gradients, the real flex attention runs forward, and benchmarks/gpu_ttt.sh compares the
compiled kernels on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_drafter_ttt import VARIANTS, grads, make_batch, make_drafter, tiny_config
from test_packing import documents, lay_out

import eaglekit.drafters.eagle3.ttt as ttt
from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.attention import span_attention, span_keys, span_mask
from eaglekit.drafters.eagle3.fused import REFERENCE, StepKernels, compile_drafter, compiled_chunk, step_kernels
from eaglekit.drafters.eagle3.head_loss import HeadTargets, head_soft_cross_entropy
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.errors import UsageError
from eaglekit.model.layers import sdpa


def dense_span_attention(q, k0, v0, lo, hi, scale, extra_k=None, extra_v=None):
    """span_attention with its mask materialised: SDPA's math path, which the CPU can differentiate."""
    keys, values = span_keys(k0, v0, extra_k, extra_v)
    n = q.shape[0]
    allowed = span_mask(lo, hi, k0.shape[0])(0, 0, torch.arange(n)[:, None], torch.arange(keys.shape[0])[None, :])
    out = sdpa(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        scale,
        attn_mask=allowed,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out[0].transpose(0, 1)


def run_step(drafter, batch, kernels, steps=4, position_ids=None):
    out = ttt_loss(
        drafter,
        *batch[:5],
        settings=TTTConfig(steps=steps),
        target_in_draft=batch[5],
        position_ids=position_ids,
        kernels=kernels,
    )
    return out, grads(drafter, out.loss)


def assert_same_step(got, want, rel=1e-10, atol=1e-12):
    (out, g), (ref, g_ref) = got, want
    assert out.count_k == ref.count_k and all(c > 0 for c in ref.count_k)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=rel)
    assert out.loss_k == pytest.approx(ref.loss_k, rel=rel)
    assert out.acc_k == ref.acc_k
    assert set(g) == set(g_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=rel * 100, atol=atol, msg=name)


def packed_batch(cfg):
    docs = documents(cfg, [9, 5, 13, 3, 7])
    packed = lay_out(docs, [[0, 1, 3], [2, 4]])  # two rows of several documents, one padded at the end
    return packed[:6], packed[6]


@pytest.mark.parametrize("variant", ["llama", "mla-yarn", "llama-eagle3.1"])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_path_equals_the_reference_in_value_and_every_gradient_float64(variant, packed, monkeypatch):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    batch, positions = packed_batch(cfg) if packed else (make_batch(cfg, length=17), None)
    want = run_step(drafter, batch, REFERENCE, position_ids=positions)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args[0].shape[0])
        return dense_span_attention(*args, **kwargs)

    monkeypatch.setattr(ttt, "span_attention", stand_in)
    got = run_step(drafter, batch, StepKernels("flex"), position_ids=positions)
    assert_same_step(got, want)
    # every draft step (and step 0 when packed) went through the span attention
    assert len(calls) == 3 + packed


@pytest.mark.parametrize("variant", ["llama", "mla-yarn"])
def test_sdpa_step_zero_equals_the_reference_float64(variant):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    batch = make_batch(cfg, length=17)
    assert_same_step(run_step(drafter, batch, StepKernels("sdpa")), run_step(drafter, batch, REFERENCE))


@pytest.mark.parametrize("variant", ["llama", "mla-yarn"])
def test_flex_attention_forward_matches_the_reference_step(variant):
    """The real flex attention (its block mask, and for MLA its padding of v) forward on the CPU, unpacked and
    packed rows."""
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    for batch, positions in [(make_batch(cfg, length=17), None), packed_batch(cfg)]:
        with torch.no_grad():
            got = ttt_loss(drafter, *batch[:5], settings=TTTConfig(steps=4), target_in_draft=batch[5], position_ids=positions,
                           kernels=StepKernels("flex"))  # fmt: skip
            want = ttt_loss(
                drafter, *batch[:5], settings=TTTConfig(steps=4), target_in_draft=batch[5], position_ids=positions
            )
        assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-10)
        assert got.loss_k == pytest.approx(want.loss_k, rel=1e-10) and got.acc_k == want.acc_k


def test_flex_span_attention_skips_blocks_outside_the_spans_exactly():
    """Several 128-row blocks, spans that start mid-block (packed documents), two earlier steps' own keys."""
    g = torch.Generator().manual_seed(0)
    n_prefix, n, heads, kv, d = 700, 300, 4, 2, 8
    rows = torch.randperm(n_prefix, generator=g)[:n].sort().values  # the chains that still count
    doc_start = torch.tensor([0, 150, 151, 420, 690])
    lo = doc_start[torch.searchsorted(doc_start, rows, right=True) - 1]
    q = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(n_prefix, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    extra_k, extra_v = (torch.randn(2, n, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    got = span_attention(q, k0, v0, lo, rows, 0.3, extra_k, extra_v)
    want = dense_span_attention(q, k0, v0, lo, rows, 0.3, extra_k, extra_v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    # the reference: prefix attention and the log-sum-exp merge of ttt.py, written out
    ref = []
    for i in range(n):
        keys = torch.cat([k0[lo[i] : rows[i] + 1], extra_k[:, i]])
        values = torch.cat([v0[lo[i] : rows[i] + 1], extra_v[:, i]])
        p = torch.softmax(torch.einsum("hd,shd->hs", q[i], keys.repeat_interleave(2, 1)) * 0.3, -1)
        ref.append(torch.einsum("hs,shd->hd", p, values.repeat_interleave(2, 1)))
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-10, atol=1e-12)


def head_inputs(dtype, m=37, h=16, vd=29, p_rows=20):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, h, generator=g, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(vd, h, generator=g, dtype=dtype)).requires_grad_()
    target_p = torch.softmax(2 * torch.randn(p_rows, vd, generator=g, dtype=dtype), -1)
    slots = torch.randint(p_rows, (m,), generator=g)
    row_weight = torch.rand(m, generator=g, dtype=dtype)
    return x, w, target_p, target_p.argmax(-1), slots, row_weight


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_head_loss_equals_the_chunked_reference(dtype, rel):
    """loss.py's chunk function compiled by inductor (C++ on the CPU, Triton on a GPU): same value and gradients,
    over chunks of two sizes (the last one shorter)."""
    x, w, target_p, target_argmax, slots, row_weight = head_inputs(dtype)
    results = []
    for chunk_fn in (None, compiled_chunk()):
        out = head_soft_cross_entropy(
            x, w, HeadTargets(target_p, target_argmax, slots, row_weight), chunk_fn=chunk_fn, chunk_rows=8
        )
        dx, dw = torch.autograd.grad(out.loss, (x, w))
        results.append((out.loss, out.ce, out.correct, dx, dw))
    (loss, ce, correct, dx, dw), (loss_c, ce_c, correct_c, dx_c, dw_c) = results
    assert loss_c.item() == pytest.approx(loss.item(), rel=rel)
    torch.testing.assert_close(ce_c, ce, rtol=rel, atol=rel)
    assert torch.equal(correct_c, correct)
    torch.testing.assert_close(dx_c, dx, rtol=rel * 10, atol=rel)
    torch.testing.assert_close(dw_c, dw, rtol=rel * 10, atol=rel)


def test_compiled_drafter_equals_the_reference_step():
    """train.ttt.compile: the drafter's per-step methods under torch.compile (aot_eager: dynamo's graphs and
    autograd as compiled, without code generation) give the reference's loss and gradients."""
    cfg = tiny_config()
    drafter = make_drafter(cfg)
    batch = make_batch(cfg, length=17)
    want = run_step(drafter, batch, REFERENCE)
    compile_drafter(drafter, backend="aot_eager")
    assert_same_step(run_step(drafter, batch, StepKernels("sdpa")), want)
    assert set(drafter.state_dict()) == set(make_drafter(cfg).state_dict())  # checkpoints unchanged


def test_step_kernels_from_the_config():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert step_kernels("auto", "auto", cpu) == REFERENCE
    assert step_kernels("sdpa", "reference", cpu).attention == "sdpa"
    fused = step_kernels("auto", "auto", cuda)  # builds no CUDA tensor: only what runs where
    assert fused.attention == "flex" and fused.head_chunk is not None
    with pytest.raises(UsageError, match="train.ttt.attention"):
        step_kernels("flex", "auto", cpu)


def test_sdpa_step_keeps_no_square_matrix_for_backward():
    """SDPA's fused kernel (GQA without repeated keys) keeps no L x L tensor for backward, as the reference."""
    cfg = tiny_config(hidden_size=16, target_hidden_size=12, intermediate_size=24, head_dim=4)
    length = 40  # larger than every width, so an L x L tensor is recognisable by its shape
    drafter = make_drafter(cfg, dtype=torch.float32)
    batch = make_batch(cfg, length=length, dtype=torch.float32)
    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(
            drafter, *batch[:5], settings=TTTConfig(steps=3), target_in_draft=batch[5], kernels=StepKernels("sdpa")
        )
    square = [s for s in saved_shapes if sum(d >= length for d in s) >= 2]
    assert not square, f"tensors of shape {square} kept for backward"


def test_span_block_mask_compiled_as_on_a_gpu_skips_exactly_the_empty_blocks():
    """create_block_mask compiled (as span_attention builds it on CUDA) over rows that start mid-block: a
    128 x 128 block is computed exactly when one of its (row, key) pairs is visible."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(2)
    n_prefix, n, steps = 700, 300, 2
    rows = torch.randperm(n_prefix, generator=g)[:n].sort().values
    doc_start = torch.tensor([0, 150, 151, 420, 690])
    lo = doc_start[torch.searchsorted(doc_start, rows, right=True) - 1]
    n_keys = n_prefix + steps * n
    mask = span_mask(lo, rows, n_prefix)
    blocks = create_block_mask(mask, None, None, n, n_keys, device="cpu", _compile=True).to_dense()[0, 0]
    allowed = mask(0, 0, torch.arange(n)[:, None], torch.arange(n_keys)[None, :])
    padded = torch.zeros(-(-n // 128) * 128, -(-n_keys // 128) * 128, dtype=torch.bool)
    padded[:n, :n_keys] = allowed
    want = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).any(3).any(1)
    assert torch.equal(blocks.bool(), want)
    assert 0.1 < want.float().mean() < 0.7  # blocks are skipped, and not all of them


def test_train_stage_with_the_fused_kernels_trains_like_the_reference(tmp_path, tiny_target):
    """train.ttt.attention sdpa, train.ttt.head_loss compiled and train.ttt.compile (the CUDA choices the CPU can run) give
    the reference's training curve; the stage records which kernels ran; flex on the CPU is refused up front."""
    from test_extract import prepared_run
    from test_train import QUICK, metrics, train

    from eaglekit.errors import EaglekitError

    runs = {}
    for name, settings in [
        ("reference", {"packing": True}),
        (
            "fused",
            {"ttt": {"steps": 3, "attention": "sdpa", "head_loss": "compiled", "compile": True}, "packing": True},
        ),
    ]:
        cfg = prepared_run(
            tmp_path / name,
            tiny_target,
            n=24,
            train={**QUICK, "max_steps": 3, "eval_every": 3, "save_every": 3, "log_every": 1, **settings},
        )
        row = train(cfg)
        runs[name] = ([r["loss"] for r in metrics(cfg) if r["kind"] == "train"], row["counts"]["step_kernels"])
    assert runs["reference"][1] == "attention reference, head loss reference"
    assert runs["fused"][1] == "attention sdpa, head loss compiled, drafter compiled"
    assert runs["fused"][0] == pytest.approx(runs["reference"][0], rel=1e-4)
    assert len(runs["fused"][0]) == 3

    cfg = prepared_run(
        tmp_path / "flex", tiny_target, n=24, train={**QUICK, "max_steps": 1, "ttt": {"steps": 3, "attention": "flex"}}
    )
    with pytest.raises(EaglekitError, match="train.ttt.attention is flex"):
        train(cfg)

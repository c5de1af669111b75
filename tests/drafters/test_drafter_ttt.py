"""The drafter and the TTT loss against a slow, obvious reference written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.model import DrafterConfig, DraftKVCache, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.errors import UsageError
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.training.figures import simulated_acceptance_length


def tiny_config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        vocab_size=39,
        draft_vocab_size=11,
        target_hidden_size=24,
        aux_layer_ids=[2, 3, 5],
    )
    base.update(kw)
    return DrafterConfig(**base)


def make_batch(cfg: DrafterConfig, b=2, length=13, dtype=torch.float64, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, length, 3 * cfg.target_hidden_size, generator=g, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (b, length), generator=g)
    target_logits = 3 * torch.randn(b, length, cfg.draft_vocab_size, generator=g, dtype=dtype)
    loss_mask = (torch.rand(b, length, generator=g) < 0.75).long()
    attention_mask = torch.ones(b, length, dtype=torch.long)
    if pad:
        attention_mask[1, length - 4 :] = 0  # right padding
    in_draft = torch.rand(b, length, generator=g) < 0.8
    return aux, ids, target_logits, loss_mask, attention_mask, in_draft


MLA = dict(
    architecture="mla",
    num_key_value_heads=None,
    head_dim=None,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
)  # v narrower than q/k (10), as in DeepSeek-V3
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
EAGLE31 = dict(fc_norm=True, norm_output=True, norm_before_residual=True)
VARIANTS = {
    "llama": {},
    "llama-eagle3.1": EAGLE31,
    "llama-norm_before_fc": dict(norm_before_fc=True),
    "mla-yarn": dict(MLA, rope_scaling=YARN),
    "mla-no-q-lora-eagle3.1": dict(MLA, q_lora_rank=None, **EAGLE31),
}


def make_drafter(cfg: DrafterConfig, dtype=torch.float64, seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg).to(dtype)
    with torch.no_grad():  # norms away from 1 so a wrong norm placement shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_qkv(drafter, emb, feature, positions):
    """q, k, v [b, L, nH, d] of the drafter's layer written out: Llama GQA, or MLA expanded from its latent."""
    cfg, layer = drafter.config, drafter.midlayer
    a, eps = layer.self_attn, cfg.rms_norm_eps
    x = torch.cat([rms(emb, layer.input_layernorm.weight, eps), rms(feature, layer.hidden_norm.weight, eps)], -1)
    b, length = x.shape[:2]
    n_heads = cfg.num_attention_heads
    angles = positions[:, None].to(x.dtype) * drafter.rotary.inv_freq.to(x.dtype)  # [L, rope/2]
    if cfg.architecture == "llama":
        n_kv, hd = cfg.num_key_value_heads, cfg.head_dim
        q = (x @ a.q_proj.weight.T).view(b, length, n_heads, hd)
        k = (x @ a.k_proj.weight.T).view(b, length, n_kv, hd)
        v = (x @ a.v_proj.weight.T).view(b, length, n_kv, hd)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]

        def rotate_halves(t):
            t1, t2 = t.chunk(2, -1)
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

        groups = n_heads // n_kv
        return (rotate_halves(q), rotate_halves(k).repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2))
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank:
        q = rms(x @ a.q_a_proj.weight.T, a.q_a_layernorm.weight, eps) @ a.q_b_proj.weight.T
    else:
        q = x @ a.q_proj.weight.T
    q_nope, q_rope = q.view(b, length, n_heads, nope + rope).split([nope, rope], -1)
    latent, k_rope = (x @ a.kv_a_proj_with_mqa.weight.T).split([cfg.kv_lora_rank, rope], -1)
    kv = (rms(latent, a.kv_a_layernorm.weight, eps) @ a.kv_b_proj.weight.T).view(b, length, n_heads, nope + dv)
    k_nope, v = kv.split([nope, dv], -1)
    turn = torch.polar(torch.full_like(angles, drafter.rotary.scale), angles)[:, None]  # [L, 1, rope/2]

    def rotate_pairs(t):  # DeepSeek's reference: consecutive pairs as complex numbers, times e^(i angle)
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * turn).flatten(-2)

    k_rope = rotate_pairs(k_rope[:, :, None]).expand(b, length, n_heads, rope)
    return torch.cat([q_nope, rotate_pairs(q_rope)], -1), torch.cat([k_nope, k_rope], -1), v


def reference_ttt(drafter, aux, ids, target_logits, loss_mask, attention_mask, steps, decay, in_draft, window=None):
    """Each step: full attention over [step-0 keys, step-1 keys, ...] with an explicit boolean mask. ``window``: the
    query of chain t at step k sits at position t + k and sees the positions after t + k - window, as vLLM serves a
    sliding-window drafter."""
    cfg, layer = drafter.config, drafter.midlayer
    eps = cfg.rms_norm_eps
    b, length = ids.shape
    if cfg.norm_before_fc:
        aux = rms(aux, drafter.input_norm.weight, eps)
    if cfg.fc_norm:
        aux = torch.cat([rms(x, n.weight, eps) for x, n in zip(aux.chunk(3, -1), drafter.fc_norm, strict=False)], -1)
    feature = aux @ drafter.fc.weight.T
    keys, values = [], []
    total, loss_k, acc_k, count_k = 0.0, [], [], []
    for k in range(steps):
        tokens = torch.zeros_like(ids)
        tokens[:, : length - 1 - k] = ids[:, 1 + k :]  # token t+1+k
        q, kk, vv = reference_qkv(drafter, drafter.embed_tokens(tokens), feature, torch.arange(length) + k)
        keys.append(kk)
        values.append(vv)
        mask = torch.zeros(length, (k + 1) * length, dtype=torch.bool)
        for t in range(length):
            mask[t, : t + 1] = True
            if window is not None:
                mask[t, : max(0, t + k - window + 1)] = False
            for j in range(1, k + 1):
                mask[t, j * length + t] = window is None or t + j > t + k - window
        scores = torch.einsum("bthd,bshd->bhts", q, torch.cat(keys, 1)) * drafter.attention_scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        attn = torch.einsum("bhts,bshd->bthd", probs, torch.cat(values, 1)).reshape(b, length, -1)
        residual = rms(feature, layer.hidden_norm.weight, eps) if cfg.norm_before_residual else feature
        h = residual + attn @ layer.self_attn.o_proj.weight.T
        h = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight, eps))
        logits = drafter.lm_head(rms(h, drafter.norm.weight, eps))
        ces, hits = [], []
        for bi in range(b):
            for t in range(length):
                j = t + 2 + k
                if j >= length or not loss_mask[bi, j] or (attention_mask is not None and not attention_mask[bi, j]):
                    continue
                if in_draft is not None and not in_draft[bi, j - 1]:
                    continue
                target = target_logits[bi, t + 1 + k]
                ces.append(-(target.softmax(-1) * logits[bi, t].log_softmax(-1)).sum())
                hits.append(float(logits[bi, t].argmax() == target.argmax()))
        step = torch.stack(ces).mean() if ces else logits.sum() * 0
        total = total + decay**k * step
        loss_k.append(step.item())
        acc_k.append(sum(hits) / len(hits) if hits else 0.0)
        count_k.append(len(ces))
        feature = rms(h, drafter.norm.weight, eps) if cfg.norm_output else h
    return total, loss_k, acc_k, count_k


def grads(drafter, loss):
    drafter.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "variant, steps, with_masks",
    [("llama", 1, False), ("llama", 2, True), ("llama", 5, True)]
    + [(v, 4, True) for v in VARIANTS if v != "llama"]
    + [("mla-yarn", 1, False)],
)
def test_ttt_matches_reference_float64(variant, steps, with_masks):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    aux, ids, tl, lm, am, ind = make_batch(cfg, pad=with_masks)
    am, ind = (am, ind) if with_masks else (None, None)

    out = ttt_loss(drafter, aux, ids, tl, lm, am, settings=TTTConfig(steps=steps, decay=0.8), target_in_draft=ind)
    got = grads(drafter, out.loss)
    ref_loss, ref_lk, ref_acc, ref_count = reference_ttt(drafter, aux, ids, tl, lm, am, steps, 0.8, ind)
    want = grads(drafter, ref_loss)

    assert out.count_k == ref_count and all(c > 0 for c in ref_count)
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    assert out.loss_k == pytest.approx(ref_lk, rel=1e-10)
    assert out.acc_k == pytest.approx(ref_acc)
    assert set(got) == set(want) and "embed_tokens.weight" not in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("variant", ["llama", "mla-yarn"])
def test_ttt_float32_matches_reference_and_keeps_no_square_matrix_for_backward(variant):
    # L larger than every width (2H, 3Ht, I, V), so an L x L tensor is recognisable by its shape.
    shape = dict(hidden_size=16, target_hidden_size=12, intermediate_size=24)
    cfg = tiny_config(**shape, head_dim=4) if variant == "llama" else tiny_config(**shape, **VARIANTS[variant])
    length = 40
    drafter = make_drafter(cfg, dtype=torch.float32)
    aux, ids, tl, lm, am, ind = make_batch(cfg, length=length, dtype=torch.float32)

    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ttt_loss(drafter, aux, ids, tl, lm, am, settings=TTTConfig(steps=4), target_in_draft=ind)
    square = [s for s in saved_shapes if sum(d >= length for d in s) >= 2]
    assert not square, f"tensors of shape {square} kept for backward"

    got = grads(drafter, out.loss)
    ref_loss, ref_lk, ref_acc, _ = reference_ttt(drafter, aux, ids, tl, lm, am, 4, 0.8, ind)
    want = grads(drafter, ref_loss)
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    assert out.acc_k == pytest.approx(ref_acc)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_ttt_prefix_attention_in_small_blocks(monkeypatch):
    """The blockwise step-0 attention gives the same result when every block is a few rows."""
    import eaglekit.drafters.eagle3.ttt as ttt

    cfg = tiny_config()
    drafter = make_drafter(cfg)
    batch = make_batch(cfg, length=17)
    whole = ttt_loss(drafter, *batch[:5], settings=TTTConfig(steps=3), target_in_draft=batch[5])
    g_whole = grads(drafter, whole.loss)
    monkeypatch.setattr(ttt, "BLOCK_ELEMENTS", 3 * cfg.num_attention_heads * 17)
    blocked = ttt_loss(drafter, *batch[:5], settings=TTTConfig(steps=3), target_in_draft=batch[5])
    g_blocked = grads(drafter, blocked.loss)
    assert blocked.loss.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    for name in g_whole:
        torch.testing.assert_close(g_blocked[name], g_whole[name], rtol=1e-10, atol=1e-12)


def test_ttt_rejects_left_padding_and_bad_shapes():
    cfg = tiny_config()
    drafter = make_drafter(cfg)
    aux, ids, tl, lm, am, _ = make_batch(cfg)
    left = am.flip(1)
    with pytest.raises(UsageError, match="right-padded"):
        ttt_loss(drafter, aux, ids, tl, lm, left)
    with pytest.raises(UsageError, match="target_logits"):
        ttt_loss(drafter, aux, ids, tl[..., :-1], lm, am)


@pytest.mark.parametrize("variant", ["llama", "mla-yarn", "mla-no-q-lora-eagle3.1"])
def test_forward_is_step_zero_and_cache_matches_full_forward(variant):
    cfg = tiny_config(**VARIANTS[variant])
    drafter = make_drafter(cfg)
    aux, ids, tl, lm, _, _ = make_batch(cfg, b=2, length=10, pad=False)
    feature = drafter.fuse(aux)
    tokens = F.pad(ids[:, 1:], (0, 1))
    pos = torch.arange(10).expand(2, 10)
    full_logits, full_hidden = drafter(tokens, feature, pos)

    # Step-0 TTT with one step is the plain forward: same loss from the forward's logits.
    with torch.no_grad():
        out = ttt_loss(drafter, aux, ids, tl, lm, None, settings=TTTConfig(steps=1))
        counted = lm[:, 2:].bool()
        ce = -(tl[:, 1:-1].softmax(-1) * full_logits[:, :-2].log_softmax(-1)).sum(-1)
        assert out.loss.item() == pytest.approx(ce[counted].mean().item(), rel=1e-10)

    # One position at a time through the cache.
    cache = DraftKVCache()
    step_logits = []
    for t in range(10):
        logits, _ = drafter(tokens[:, t : t + 1], feature[:, t : t + 1], pos[:, t : t + 1], cache)
        step_logits.append(logits)
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(step_logits, 1), full_logits, rtol=1e-10, atol=1e-10)

    # Reject the last 4, then feed other tokens and the drafter's own hidden: same as a full forward of that sequence.
    cache.crop(6)
    assert cache.length == 6
    new_tokens = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(1))
    new_hidden = full_hidden[:, 3:6]
    logits, _ = drafter(new_tokens, new_hidden, pos[:, 6:9], cache)
    ref_logits, _ = drafter(
        torch.cat([tokens[:, :6], new_tokens], 1), torch.cat([feature[:, :6], new_hidden], 1), pos[:, :9]
    )
    torch.testing.assert_close(logits, ref_logits[:, 6:9], rtol=1e-10, atol=1e-10)


def test_d2t_t2d_round_trip():
    selected = torch.tensor([0, 3, 4, 9, 17, 38])
    d2t, t2d = build_d2t_t2d(selected, 39)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (39,)
    assert torch.equal(t2d.nonzero().squeeze(1), selected)
    cfg = tiny_config(draft_vocab_size=6)
    drafter = Eagle3Drafter(cfg)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    assert torch.equal(drafter.draft_to_target(torch.arange(6)), selected)
    assert torch.equal(drafter.draft_to_target(torch.tensor([[5, 1]])), torch.tensor([[38, 3]]))
    with pytest.raises(UsageError, match="sorted"):
        build_d2t_t2d(torch.tensor([3, 1]), 39)
    with pytest.raises(UsageError, match="0..38"):
        build_d2t_t2d(torch.tensor([1, 39]), 39)


def test_state_dict_is_the_checkpoint_key_set():
    drafter = Eagle3Drafter(tiny_config())
    state = drafter.state_dict()
    mid = "midlayer."
    assert set(state) == {
        "embed_tokens.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        mid + "hidden_norm.weight",
        mid + "input_layernorm.weight",
        mid + "post_attention_layernorm.weight",
        *(f"{mid}self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"{mid}mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert state["fc.weight"].shape == (32, 3 * 24)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 32)
    assert not drafter.embed_tokens.weight.requires_grad


def test_from_target_config_llama():
    target = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=10,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    )
    cfg = DrafterConfig.from_target_config(target, draft_vocab_size=40)
    assert cfg.aux_layer_ids == [2, 5, 7]
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (48, 48, 8, 2)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.max_position_embeddings) == (101, 40, 4096)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rms_norm_eps == 1e-5
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg

    # The drafter's RoPE is the target's (llama3 scaling included).
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(target)
    pos = torch.arange(0, 3000, 7)[None]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = Eagle3Drafter(cfg).rotary(pos, torch.float32)
    torch.testing.assert_close(cos, want_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, want_sin, rtol=1e-5, atol=1e-5)

    small = DrafterConfig.from_target_config(
        target, 40, aux_layer_ids=[1, 4, 9], hidden_size=24, intermediate_size=None
    )
    assert (small.hidden_size, small.head_dim, small.target_hidden_size, small.intermediate_size) == (24, 4, 48, 96)
    assert small.aux_layer_ids == [1, 4, 9]
    with pytest.raises(UsageError, match="hiden_size"):
        DrafterConfig.from_target_config(target, 40, hiden_size=24)
    with pytest.raises(UsageError, match="outside 0..10"):
        DrafterConfig.from_target_config(target, 40, aux_layer_ids=[1, 4, 11])


def test_from_target_config_qwen3():
    target = Qwen3Config(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=120,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
    )
    cfg = DrafterConfig.from_target_config(target, draft_vocab_size=50)
    assert cfg.head_dim == 32  # explicit in the config, not hidden/heads
    assert cfg.aux_layer_ids == [2, 4, 5]
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 2048
    drafter = Eagle3Drafter(cfg)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (4 * 32, 128)


def test_simulated_acceptance_length():
    acc = [0.8, 0.5, 0.25]
    assert simulated_acceptance_length(acc) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25)
    assert simulated_acceptance_length([]) == 1.0


# ------------------------------------------------------------------------------- the fused head + soft CE


def plain_head_loss(x, weight, target_p, slots, row_weight):
    """What the fused function replaces: lm_head, then F.cross_entropy with soft targets, per row."""
    ce = F.cross_entropy(x @ weight.T, target_p[slots], reduction="none")
    return (ce * row_weight).sum(), ce


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_fused_head_loss_matches_plain_cross_entropy_float64(chunk_rows):
    from eaglekit.drafters.eagle3.head_loss import HeadTargets, head_soft_cross_entropy

    g = torch.Generator().manual_seed(3)
    m, h, vd, p = 23, 16, 37, 9
    x = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vd, h, generator=g, dtype=torch.float64, requires_grad=True)
    target_p = (2 * torch.randn(p, vd, generator=g, dtype=torch.float64)).softmax(-1)
    slots = torch.randint(0, p, (m,), generator=g)
    row_weight = torch.rand(m, generator=g, dtype=torch.float64)
    targets = HeadTargets(target_p, target_p.argmax(-1), slots, row_weight)

    fused = head_soft_cross_entropy(x, weight, targets, chunk_rows=chunk_rows)
    gx, gw = torch.autograd.grad(3.0 * fused.loss, (x, weight))
    want, want_ce = plain_head_loss(x, weight, target_p, slots, row_weight)
    wx, ww = torch.autograd.grad(3.0 * want, (x, weight))

    assert fused.loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(fused.ce, want_ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, wx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=1e-10, atol=1e-12)
    assert torch.equal(fused.correct, (x @ weight.T).argmax(-1) == target_p.argmax(-1)[slots])
    # frozen head: only x gets a gradient, and the same one
    frozen = head_soft_cross_entropy(x, weight.detach(), targets, chunk_rows=chunk_rows)
    torch.testing.assert_close(torch.autograd.grad(3.0 * frozen.loss, x)[0], wx, rtol=1e-10, atol=1e-12)


def test_ttt_keeps_no_draft_vocab_wide_tensor_for_backward():
    """The soft cross-entropy used to keep its log-softmax and target probabilities ([N, Vd] each) per step."""
    cfg = tiny_config(draft_vocab_size=29)  # Vd unlike every other width (H 32, 2H, 3Ht 72, I 36, V 39)
    drafter = make_drafter(cfg, dtype=torch.float32)
    aux, ids, tl, lm, am, ind = make_batch(cfg, length=30, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = ttt_loss(drafter, aux, ids, tl, lm, am, settings=TTTConfig(steps=4), target_in_draft=ind)
    wide = [s for s in saved if cfg.draft_vocab_size in s and s != tuple(drafter.lm_head.weight.shape)]
    assert not wide, f"[N, Vd] tensors kept for backward: {wide}"
    assert out.count_k[0] > 20

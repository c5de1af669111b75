"""Building blocks shared by the drafter's two decoder layers (Llama attention in ``drafter.py``, multi-head
latent attention in ``mla.py``): RMSNorm, the SwiGLU MLP, RoPE tables and their two layouts, attention with
q/k and v of different widths, and the EAGLE-3 layer skeleton around the attention.

The skeleton is what every EAGLE-3 drafter layer shares (vLLM ``llama_eagle3.py`` / ``deepseek_eagle3.py``):

    x        = cat(input_layernorm(embed), hidden_norm(feature))      # 2H wide: the attention's input
    residual = feature  (or hidden_norm(feature) with norm_before_residual)
    h        = residual + o_proj(attention(x))
    out      = h + mlp(post_attention_layernorm(h))                    # the layer's pre-norm output

The attention itself is done by the caller (the KV-cached forward, or TTT's memory-lean attention), so a
layer exposes ``qkv(embeds, feature, cos, sin)`` and ``finish(attn, feature)`` around it, and says its
head counts and widths (``n_heads``, ``n_kv``, ``head_dim`` of q/k, ``v_dim``) and softmax ``scale``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.errors import UsageError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------------- RoPE


class Rotary:
    """cos/sin tables for given positions, in the cat(freqs, freqs) layout of transformers.

    Not a module: inv_freq must stay full precision when the model is cast. ``scale`` multiplies cos and
    sin (YaRN's attention factor).
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        self.inv_freq, self.scale = inv_freq, scale
        self._on_device: dict[tuple, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        key = (positions.device, compute)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freq.to(positions.device, compute)
        freqs = positions.to(compute)[..., None] * self._on_device[key]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, d]; cos/sin [..., T, d]. Neox-style rotate-half, as Llama."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: dims (0,1), (2,3), ... rotate as pairs (vLLM ``is_neox_style=False``).

    The result is laid out [rotated evens, rotated odds], as transformers' ``apply_rotary_pos_emb_interleave``
    does; q and k get the same permutation, so every q.k product equals vLLM's in-place pair rotation.
    """
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------- attention


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, nKV, S, d] -> [B, nKV*groups, S, d] for grouped-query attention."""
    if groups == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs) -> torch.Tensor:
    """``scaled_dot_product_attention`` ([B, heads, T, d]) where v may be narrower or wider than q/k (MLA).

    The fused kernels, which keep no L x L matrix for backward, need one head width; zero-padding the narrower
    side changes neither the scores (the scale is explicit) nor the output's first ``v`` columns.
    """
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    elif d_qk < d_v:
        q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kwargs)[..., :d_v]


# ------------------------------------------------------------------------------------------ layer skeleton


class AttentionProjections(nn.Module):
    """The attention's projections (the subclass adds q/k/v); the attention itself is done by the caller."""

    o_proj: nn.Linear


class Eagle3Block(nn.Module):
    """The EAGLE-3 decoder layer without its attention projections (``self_attn``, set by the subclass)."""

    self_attn: AttentionProjections

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """[..., T, H] token embeddings and features -> the attention's input [..., T, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)

    def finish(self, attn: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """attn [..., T, nH, v_dim] -> the layer's pre-norm output [..., T, H]."""
        residual = self.hidden_norm(feature) if self.norm_before_residual else feature
        h = residual + self.self_attn.o_proj(attn.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


def rope_inv_freq(cfg: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and the cos/sin scale of a Llama-style layer's RoPE, as the target computes them.
    ``cfg``: a drafter config with rope_theta, rope_scaling, max_position_embeddings, num_attention_heads and
    ``llama_heads`` (EAGLE-3's Llama layer, DFlash's layers)."""
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    _, head_dim = cfg.llama_heads
    if rope_type == "default":
        return 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim), 1.0
    # Every scaled variant (linear, llama3, yarn, ...) comes from transformers so it matches the target exactly.
    from transformers import LlamaConfig  # lazy: heavy (transformers)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: heavy (transformers)

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UsageError(
            f"drafter config: rope_scaling.rope_type '{rope_type}' is not supported",
            f"supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}",
        )
    hf = LlamaConfig(
        hidden_size=cfg.num_attention_heads * head_dim,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # transformers 5's signature omits the v4 keys it still takes
        rope_scaling={**scaling, "rope_type": rope_type},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.to(torch.float64), float(attention_scaling)

"""The EAGLE-3 draft model: one Llama decoder layer fed by the target's fused hidden states.

Parameter names are the checkpoint keys of FORMATS.md §4, so ``state_dict()`` is the export:

    fc                 [H, 3*Ht]  fuses the three aux hidden states of the target into one feature
    midlayer           one decoder layer whose q/k/v read cat(input_layernorm(embed), hidden_norm(feature))
    norm, lm_head      the head over the draft vocabulary [Vd, H]
    d2t, t2d           draft id -> target id offsets, and the target ids that the draft vocab covers
    embed_tokens       the target's token embedding, frozen

The residual stream of the layer is the (un-normed) feature, as in vLLM's and SGLang's
``llama_eagle3.py`` with ``norm_before_residual = false``. The layer's pre-norm output is what a
next draft step takes as its feature; ``norm`` + ``lm_head`` of it give the draft logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.errors import UsageError


def text_config(hf_config: Any) -> Any:
    """The language-model part of a HF config (multimodal configs nest it); dicts are accepted too."""
    if isinstance(hf_config, dict):
        hf_config = SimpleNamespace(**hf_config)
    get_text = getattr(hf_config, "get_text_config", None)
    if callable(get_text):
        return get_text()
    nested = getattr(hf_config, "text_config", None)
    return text_config(nested) if nested is not None else hf_config


def rope_from_config(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a HF config, transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):  # per-layer-type rope (e.g. gemma): take full attention
            params = params.get("full_attention") or next(iter(params.values()))
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, scaling


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # V, the target's vocabulary
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    aux_layer_ids: list[int] | None  # HF hidden_states indices; None = the servers' default [2, N//2, N-3]
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"drafter config: '{name}' must be a positive integer, got {value!r}",
                                 "fix the value in the drafter config or the train.draft overrides")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(f"drafter config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})",
                             "pick a divisor of num_attention_heads for num_key_value_heads")
        if self.head_dim % 2:
            raise UsageError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}",
                             "use an even head_dim")
        if self.draft_vocab_size > self.vocab_size:
            raise UsageError(f"drafter config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                             f"({self.vocab_size})", "set vocab.draft_vocab_size to at most the target's vocabulary")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
            if len(self.aux_layer_ids) != 3:
                raise UsageError(f"drafter config: EAGLE-3 fuses exactly 3 aux hidden states, got aux_layer_ids="
                                 f"{self.aux_layer_ids}", "give three HF hidden_states indices, e.g. [2, N//2, N-3]")
        if self.hidden_act != "silu":
            raise UsageError(f"drafter config: hidden_act '{self.hidden_act}' is not supported", "use 'silu'")

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int] | None = None,
                           **overrides: Any) -> "DrafterConfig":
        """Derive a drafter config from a HF Llama/Qwen-style target config.

        The drafter copies the target's layer shapes, RoPE and max_position_embeddings (a drafter
        served with another max_position_embeddings than it was trained with loses acceptance).
        ``overrides`` replace fields (None values are ignored); overriding hidden_size or the head
        count without head_dim recomputes head_dim = hidden_size // num_attention_heads.
        """
        tc = text_config(hf_config)

        def need(name: str) -> int:
            if getattr(tc, name, None) is None:
                raise UsageError(f"the target's config has no '{name}'",
                                 "eaglekit derives the drafter from a Llama/Qwen-style decoder config; "
                                 "for a drafter shape (e.g. intermediate_size) set it under train.draft")
            return int(getattr(tc, name))

        n_layers = need("num_hidden_layers")
        if aux_layer_ids is None:
            aux_layer_ids = [2, n_layers // 2, n_layers - 3]
        bad = [i for i in aux_layer_ids if not 0 <= int(i) <= n_layers]
        if bad:
            raise UsageError(f"aux layer ids {bad} are outside 0..{n_layers} (the target has {n_layers} layers; "
                             "ids are HF hidden_states indices, 0 = embeddings)", "fix target.aux_layers")
        heads, hidden = need("num_attention_heads"), need("hidden_size")
        theta, scaling = rope_from_config(tc)
        fields = dict(
            hidden_size=hidden,
            intermediate_size=overrides.get("intermediate_size") or need("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(tc, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=need("max_position_embeddings"),
            vocab_size=need("vocab_size"),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
        )
        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(overrides) - set(fields) - {"hidden_act"})
        if unknown:
            raise UsageError(f"unknown drafter config override(s): {unknown}",
                             f"use only fields of DrafterConfig: {sorted(fields)}")
        if ("hidden_size" in overrides or "num_attention_heads" in overrides) and "head_dim" not in overrides:
            overrides["head_dim"] = overrides.get("hidden_size", fields["hidden_size"]) // overrides.get(
                "num_attention_heads", heads)
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(d) - names), sorted(n for n in names - set(d) if n != "hidden_act")
        if unknown or missing:
            raise UsageError(f"drafter config: unknown keys {unknown}, missing keys {missing}",
                             "the drafter config was written by another version; re-export it")
        return cls(**d)


def build_d2t_t2d(selected_target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary mapping buffers for draft vocab = ``selected_target_ids`` (sorted, unique).

    d2t[i] = selected[i] - i (so target = draft + d2t[draft]); t2d[j] is True for selected target ids.
    """
    ids = torch.as_tensor(selected_target_ids).to(torch.long).cpu()
    if ids.dim() != 1 or ids.numel() == 0:
        raise UsageError(f"selected target ids must be a non-empty 1-D tensor, got shape {list(ids.shape)}",
                         "pass the sorted target token ids of the draft vocabulary")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise UsageError(f"selected target ids must lie in 0..{vocab_size - 1}, "
                         f"got {ids.min().item()}..{ids.max().item()}",
                         "the draft vocabulary was built for another tokenizer; rerun the vocab stage")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise UsageError("selected target ids must be sorted and unique", "sort them (torch.unique does both)")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


# ---------------------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and the cos/sin scale of the drafter's RoPE, as the target computes them."""
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim), 1.0
    # Every scaled variant (linear, llama3, yarn, ...) comes from transformers so it matches the target exactly.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UsageError(f"drafter config: rope_scaling.rope_type '{rope_type}' is not supported",
                         f"supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    hf = LlamaConfig(hidden_size=cfg.num_attention_heads * cfg.head_dim, num_attention_heads=cfg.num_attention_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                     rope_theta=cfg.rope_theta, rope_scaling={**scaling, "rope_type": rope_type})
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.to(torch.float64), float(attention_scaling)


class Rotary:
    """cos/sin tables for given positions. Not a module: inv_freq must stay full precision when the model is cast."""

    def __init__(self, cfg: DrafterConfig):
        self.inv_freq, self.scale = rope_inv_freq(cfg)
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
    """x [..., T, heads, hd]; cos/sin [..., T, hd] (neox-style rotate-half, as Llama)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------------------------------------------------------
# The model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Holds the projections; the attention itself is done by the caller (inference cache or TTT)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer, split around the attention so TTT can attend its own way."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[..., T, H] inputs -> q [..., T, nH, hd], k and v [..., T, nKV, hd], RoPE applied to q and k."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        a = self.self_attn
        q = a.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = a.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = a.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """attn [..., T, nH, hd] -> the layer's pre-norm output [..., T, H]; the residual is the feature."""
        h = feature + self.self_attn.o_proj(attn.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, nKV, S, hd] -> [B, nKV*groups, S, hd] for grouped-query attention."""
    if groups == 1:
        return x
    b, n_kv, s, hd = x.shape
    return x[:, :, None].expand(b, n_kv, groups, s, hd).reshape(b, n_kv * groups, s, hd)


class DraftKVCache:
    """Keys and values of positions the drafter has seen, [B, nKV, S, hd] each; all rows share one length."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions (drop rejected drafts)."""
        if n < 0:
            raise ValueError(f"cannot crop a KV cache to {n} positions")
        if self.k is not None and n < self.length:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_d2t_t2d(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.rotary = Rotary(cfg)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*Ht] concatenated aux hidden states of the target -> the fused feature [B, T, H]."""
        if aux_hidden.shape[-1] != self.fc.in_features:
            raise UsageError(f"aux hidden states have width {aux_hidden.shape[-1]}, the drafter's fc expects "
                             f"{self.fc.in_features} (3 x target hidden size {self.config.target_hidden_size})",
                             "capture exactly three aux layers of the target this drafter was built for")
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: DraftKVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass: (logits [B, T, Vd], hidden_out [B, T, H]).

        ``hidden`` is the fused target feature at each position (or the drafter's own previous
        ``hidden_out``) and ``input_ids`` the token that follows that position. With a cache, the new
        keys/values are appended and attention is causal over cache + new positions.
        """
        cos, sin = self.rotary(position_ids, hidden.dtype)
        q, k, v = self.midlayer.qkv(self.embed_tokens(input_ids), hidden, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            t_new, s = q.shape[2], k.shape[2]
            mask = torch.arange(s, device=q.device)[None, :] <= past + torch.arange(t_new, device=q.device)[:, None]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        hidden_out = self.midlayer.finish(attn.transpose(1, 2), hidden)
        return self.lm_head(self.norm(hidden_out)), hidden_out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.config.head_dim)

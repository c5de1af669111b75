"""The MLA drafter layer: the EAGLE-3 layer with DeepSeek-V2/V3 multi-head latent attention.

The drafters published for Kimi-K2.5/K2.6 (``kimi-k2.5-eagle3-mla``, ``eagle3.1-mla``) and SpecForge's
DeepSeek drafter pair the EAGLE-3 layout with the attention of their targets. vLLM serves them as
``Eagle3DeepseekV2ForCausalLM`` (``model_executor/models/deepseek_eagle3.py``, attention from
``deepseek_v2.DeepseekV2MLAAttention``), SGLang as ``Eagle3DeepseekV2ForCausalLM`` (``kimi_k25_eagle3.py``).
Parameter names are the checkpoint keys those loaders read::

    self_attn.q_a_proj            [q_lora_rank, 2H]           (q_lora_rank set; else self_attn.q_proj [nH*(nope+rope), 2H])
    self_attn.q_a_layernorm       [q_lora_rank]
    self_attn.q_b_proj            [nH*(nope+rope), q_lora_rank]
    self_attn.kv_a_proj_with_mqa  [kv_lora_rank + rope, 2H]   the latent c_kv and one shared rotary key
    self_attn.kv_a_layernorm      [kv_lora_rank]
    self_attn.kv_b_proj           [nH*(nope+v), kv_lora_rank] per-head non-rotary keys and values from c_kv
    self_attn.o_proj              [H, nH*v]

Per head, q = [q_nope | q_rope] and k = [k_nope | k_rope] (k_rope shared by all heads); RoPE rotates only the
rope part, in DeepSeek's interleaved-pair layout. Values are ``v_head_dim`` wide, so the attention output is
narrower than q/k. Softmax scale: 1/sqrt(nope+rope), times mscale(factor, mscale_all_dim)^2 under YaRN.

RoPE: vLLM turns any rope scaling of such a layer into ``deepseek_yarn`` (``DeepseekScalingRotaryEmbedding``),
whose tables are computed here the way vLLM computes them (``rotary_embedding/deepseek_scaling_rope.py``).
Other scalings (llama3, linear, ...) would be served as something else, so they are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from eaglekit.errors import UsageError
from eaglekit.model.layers import AttentionProjections, Eagle3Block, RMSNorm, Rotary, apply_rope_interleaved


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_kind(scaling: dict | None) -> str:
    return "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))


def check_rope(scaling: dict | None) -> None:
    kind = rope_kind(scaling)
    if kind not in ("default", "yarn"):
        raise UsageError(
            f"drafter config: an MLA drafter takes no rope_scaling of type '{kind}' (vLLM's and SGLang's "
            "MLA drafters serve any rope scaling as DeepSeek YaRN)",
            "use train.draft.architecture: llama for this target, or a target with YaRN or no scaling",
        )
    if scaling is not None and kind == "yarn":
        missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
        if missing:
            raise UsageError(
                f"drafter config: rope_scaling of type yarn lacks {missing}",
                "copy the target's rope_scaling (DeepSeek-V3: factor 40, original_max_position_embeddings "
                "4096, mscale 1, mscale_all_dim 1)",
            )


def deepseek_rope(cfg) -> tuple[torch.Tensor, float, float]:
    """(inv_freq float64 [rope/2], cos/sin scale, softmax scale multiplier) of the MLA layer's RoPE."""
    dim, base, scaling = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    check_rope(scaling)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope_kind(scaling) == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    factor = float(scaling["factor"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp  # share of each frequency kept as trained (the fast ones)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    mscale, mscale_all_dim = float(scaling.get("mscale", 1) or 0), float(scaling.get("mscale_all_dim", 0) or 0)
    cos_sin_scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return inv_freq, cos_sin_scale, yarn_get_mscale(factor, mscale_all_dim) ** 2


class MLAAttention(AttentionProjections):
    """The projections of multi-head latent attention over the 2H-wide EAGLE-3 input."""

    def __init__(self, cfg):
        super().__init__()
        h2, n = 2 * cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h2, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h2, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, cfg.hidden_size, bias=False)


class MLALayer(Eagle3Block):
    self_attn: MLAAttention

    def __init__(self, cfg):
        super().__init__(cfg)
        self.self_attn = MLAAttention(cfg)
        self.nope, self.rope, self.kv_lora_rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        # every head gets its own keys and values, expanded from the shared latent
        self.n_heads = self.n_kv = cfg.num_attention_heads
        self.head_dim, self.v_dim = self.nope + self.rope, cfg.v_head_dim
        _, _, softmax_factor = deepseek_rope(cfg)
        self.scale = softmax_factor / math.sqrt(self.head_dim)

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[..., T, H] inputs -> q, k [..., T, nH, nope+rope] and v [..., T, nH, v], RoPE applied to q and k."""
        x = self.attention_input(embeds, feature)
        a = self.self_attn
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))) if hasattr(a, "q_a_proj") else a.q_proj(x)
        q_nope, q_rope = q.unflatten(-1, (self.n_heads, self.head_dim)).split([self.nope, self.rope], dim=-1)
        latent, k_rope = a.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = a.kv_b_proj(a.kv_a_layernorm(latent)).unflatten(-1, (self.n_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(k_rope.unsqueeze(-2), cos, sin).expand_as(q_rope)
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1), v


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
NO_MLA_SPECULATORS = (
    "an MLA drafter has no speculators form: vLLM's speculators reader (vllm/transformers_utils/"
    "configs/speculators/algos.py, update_eagle3) accepts transformer_layer_config.model_type "
    "llama and qwen3 only and raises 'Unsupported model_type deepseek_v2 for Eagle3 speculator'"
)


class MlaLayerKind:
    """The EAGLE-3 drafter's layer kind with latent attention (``model/eagle3.Eagle3LayerKind``), served as
    vLLM's and SGLang's ``Eagle3DeepseekV2ForCausalLM``."""

    windowed = False
    legacy_architecture = "Eagle3DeepseekV2ForCausalLM"
    legacy_prefix = "layers.0."
    no_speculators: str | None = NO_MLA_SPECULATORS

    def check(self, cfg: Any, positive: Callable[..., None]) -> None:
        positive("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        rope_dim = cfg.mla_shape.qk_rope_head_dim
        if cfg.q_lora_rank is not None:
            positive("q_lora_rank")
        stray = [n for n in ("num_key_value_heads", "head_dim") if getattr(cfg, n) is not None]
        if stray:
            raise UsageError(
                f"drafter config: {stray} apply to architecture llama; an MLA drafter's heads are "
                "shaped by qk_nope_head_dim, qk_rope_head_dim and v_head_dim",
                "remove them, or set train.draft.architecture: llama",
            )
        if rope_dim % 2:
            raise UsageError(
                f"drafter config: qk_rope_head_dim must be even for RoPE, got {rope_dim}",
                "use an even qk_rope_head_dim",
            )
        if cfg.norm_before_fc:
            raise UsageError(
                "drafter config: norm_before_fc (input_norm) does not exist in the MLA drafters of vLLM "
                "(deepseek_eagle3.py) and SGLang (kimi_k25_eagle3.py)",
                "use fc_norm (one norm per aux hidden state) instead",
            )
        check_rope(cfg.rope_scaling)

    def target_shapes(self, fields: dict[str, Any], tc: Any, overrides: dict[str, Any], head_width: int) -> None:
        """The target's latent-attention shapes when it has them (DeepSeek-V3, Kimi-K2), else DeepSeek-V3's
        proportions of the target's head width d; q_lora_rank always set (``DrafterConfig.from_target_config``)."""
        stray = sorted({"num_key_value_heads", "head_dim"} & set(overrides))
        if stray:
            raise UsageError(
                f"train.draft: {stray} apply to architecture llama; an MLA drafter's heads are shaped "
                "by qk_nope_head_dim, qk_rope_head_dim and v_head_dim",
                f"remove {stray}",
            )
        if getattr(tc, "kv_lora_rank", None):
            fields.update({name: getattr(tc, name, None) for name in MLA_FIELDS})
            fields["q_lora_rank"] = fields["q_lora_rank"] or 12 * fields["qk_nope_head_dim"]
        else:
            d = int(getattr(tc, "v_head_dim", None) or head_width)
            fields.update(
                q_lora_rank=12 * d,
                kv_lora_rank=4 * d,
                qk_nope_head_dim=d,
                qk_rope_head_dim=max(2, d // 4 * 2),
                v_head_dim=d,
            )
        fields.update(num_key_value_heads=None, head_dim=None)

    def reads_layer(self, layer: dict) -> bool:
        return bool(layer.get("kv_lora_rank"))  # DeepSeek-V2/V3-shaped

    def fields_from_layer(self, layer: dict, need: Callable[[str], Any]) -> dict[str, Any]:
        q_lora = layer.get("q_lora_rank")
        return {
            "architecture": "mla",
            "num_key_value_heads": None,
            "head_dim": None,
            "q_lora_rank": int(q_lora) if q_lora else None,
            **{name: int(need(name)) for name in MLA_FIELDS[1:]},
        }

    def build(self, cfg: Any) -> tuple[MLALayer, Rotary]:
        return MLALayer(cfg), Rotary(*deepseek_rope(cfg)[:2])

    def key_value_elements(self, cfg: Any) -> int:
        """Per head, decompressed."""
        mla = cfg.mla_shape
        return cfg.num_attention_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)

    def attention_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        h2, n, mla = 2 * cfg.hidden_size, cfg.num_attention_heads, cfg.mla_shape
        qk, rope = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_rope_head_dim
        q: dict[str, tuple[int, ...]] = (
            {
                "q_a_proj": (mla.q_lora_rank, h2),
                "q_a_layernorm": (mla.q_lora_rank,),
                "q_b_proj": (n * qk, mla.q_lora_rank),
            }
            if mla.q_lora_rank
            else {"q_proj": (n * qk, h2)}
        )
        return {
            **q,
            "kv_a_proj_with_mqa": (mla.kv_lora_rank + rope, h2),
            "kv_a_layernorm": (mla.kv_lora_rank,),
            "kv_b_proj": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "o_proj": (cfg.hidden_size, n * mla.v_head_dim),
        }

    def layer_config(self, cfg: Any) -> dict[str, Any]:
        return {
            "model_type": "deepseek_v2",
            "num_key_value_heads": cfg.num_attention_heads,
            **{name: getattr(cfg, name) for name in MLA_FIELDS},
            "rope_interleave": True,
        }

    def serving_problems(self, cfg: Any) -> list[str]:
        if cfg.q_lora_rank:
            return []
        return [
            "q_lora_rank is null (one q_proj): vLLM's deepseek_eagle3.py maps kv_a_proj_with_mqa onto "
            "fused_qkv_a_proj, which exists only with q_lora_rank, and SGLang's kimi_k25_eagle3.py raises "
            "'Eagle3 MLA layer requires q_lora_rank in the draft config'"
        ]

    def fused_a_split(self, cfg: Any) -> tuple[int, int] | None:
        """vLLM's fused_qkv_a_proj and SGLang's fused_qkv_a_proj_with_mqa: q_a_proj's rows, then
        kv_a_proj_with_mqa's."""
        mla = cfg.mla_shape
        return (mla.q_lora_rank, mla.kv_lora_rank + mla.qk_rope_head_dim) if mla.q_lora_rank else None


MLA_LAYER = MlaLayerKind()

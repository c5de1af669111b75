"""The EAGLE-3 draft model: a decoder layer (or several) fed by the target's fused hidden states.

Parameter names are the checkpoint keys of docs/formats.md §11, so ``state_dict()`` is the export:

    fc_norm.{0,1,2}    [Ht]       (fc_norm) an RMSNorm per aux hidden state before fc (EAGLE 3.1)
    input_norm         [3*Ht]     (norm_before_fc) one RMSNorm over the concatenated aux states before fc
    fc                 [H, 3*Ht]  fuses the three aux hidden states of the target into one feature
    midlayer           the first decoder layer, whose attention reads cat(input_layernorm(embed), hidden_norm(feature))
    upper_layers.{j}   with num_layers > 1, layers 1.. (``layers.{j+1}.`` on disk): plain Llama decoder layers over
                       the previous layer's pre-norm output, H wide, no token embedding (vLLM ``llama_eagle3.py``,
                       layer_idx >= 1); each keeps its own keys and values
    norm, lm_head      the head over the draft vocabulary [Vd, H]
    d2t, t2d           draft id -> target id offsets, and the target ids that the draft vocab covers
    embed_tokens       the target's token embedding, frozen

The layer is a Llama decoder layer (``architecture: llama``, below) or one with DeepSeek's multi-head
latent attention (``architecture: mla``, ``mla.py``); both share the skeleton of ``layers.py``. The flags,
named as vLLM's ``llama_eagle3.py`` / ``deepseek_eagle3.py`` and SGLang's configs name them:

    norm_before_residual  the layer's residual is hidden_norm(feature) instead of the raw feature
    norm_output           a next draft step takes norm(out) as its feature instead of the pre-norm out
    fc_norm, norm_before_fc   the norms before fc above (mutually exclusive, as in speculators' config)

With all flags off this is the EAGLE-3 drafter of the reference code, vLLM and SGLang: the residual is the
un-normed feature, a next step takes the pre-norm output, and ``norm`` + ``lm_head`` give the logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from eaglekit.drafters.eagle3.mla_layer import MLA_FIELDS, MLA_LAYER, MLALayer
from eaglekit.errors import UsageError
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.model.layers import (
    AttentionProjections,
    Eagle3Block,
    RMSNorm,
    Rotary,
    apply_rope,
    repeat_kv,
    rope_inv_freq,
    sdpa,
)
from eaglekit.model.target import rope_from_config, text_config

FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
__all__ = ["DrafterConfig", "Eagle3Drafter", "DraftKVCache", "apply_rope", "repeat_kv"]


class MLAShape(NamedTuple):
    """The latent-attention widths of an ``mla`` drafter, all set (DrafterConfig checks them on construction)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int | None  # llama: K/V heads (GQA); None for mla (keys and values come from one latent)
    head_dim: int | None  # llama: width of a head; None for mla (qk_nope_head_dim + qk_rope_head_dim, v_head_dim)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # V, the target's vocabulary
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    aux_layer_ids: list[int] | None  # HF hidden_states indices; None = the servers' default [2, N//2, N-3]
    hidden_act: str = "silu"
    architecture: str = "llama"  # "llama" | "mla"
    # multi-head latent attention (architecture "mla"), as DeepSeek-V2/V3 and Kimi-K2 name them
    q_lora_rank: int | None = None  # None (published checkpoints only): one q_proj instead of q_a_proj/q_b_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # EAGLE 3.1 and related flags (module docstring)
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    # the query's position and the sliding_window - 1 before it (vLLM's convention); None: every earlier position
    sliding_window: int | None = None
    # decoder layers (num_hidden_layers on disk): the first reads the token embedding and the feature, the others the
    # previous layer's output, as vLLM's llama_eagle3.py serves them
    num_layers: int = 1

    def __post_init__(self) -> None:
        def positive(*names: str) -> None:
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise UsageError(
                        f"drafter config: '{name}' must be a positive integer, got {value!r}",
                        "fix the value in the drafter config or the train.draft overrides",
                    )

        positive(
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "max_position_embeddings",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_layers",
        )
        if self.architecture not in LAYERS:
            raise UsageError(
                f"drafter config: architecture '{self.architecture}' is not one of {list(LAYERS)}",
                "set train.draft.architecture to llama or mla",
            )
        self.layer.check(self, positive)
        if self.num_layers > 1 and self.layer is not LLAMA_LAYER:
            raise UsageError(
                f"drafter config: num_layers {self.num_layers}: eaglekit builds an {self.architecture} drafter with "
                "one decoder layer (vLLM's deepseek_eagle3.py would serve several; eaglekit's MLA layer has no "
                "H-wide upper layers yet)",
                "use num_layers 1 for architecture mla, or architecture llama for several layers",
            )
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise UsageError(
                    f"drafter config: '{name}' must be true or false, got {getattr(self, name)!r}",
                    f"set train.draft.{name} to true or false",
                )
        if self.fc_norm and self.norm_before_fc:
            raise UsageError(
                "drafter config: fc_norm and norm_before_fc are mutually exclusive (one norm per aux "
                "state, or one over their concatenation; speculators' config refuses both)",
                "set only one of train.draft.fc_norm and train.draft.norm_before_fc",
            )
        if self.draft_vocab_size > self.vocab_size:
            raise UsageError(
                f"drafter config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})",
                "set vocab.draft_vocab_size to at most the target's vocabulary",
            )
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
            if len(self.aux_layer_ids) != 3:
                raise UsageError(
                    f"drafter config: EAGLE-3 fuses exactly 3 aux hidden states, got aux_layer_ids="
                    f"{self.aux_layer_ids}",
                    "give three HF hidden_states indices, e.g. [2, N//2, N-3]",
                )
        if self.sliding_window is not None:
            if (
                isinstance(self.sliding_window, bool)
                or not isinstance(self.sliding_window, int)
                or self.sliding_window < 2
            ):
                raise UsageError(
                    f"drafter config: 'sliding_window' must be an integer of at least 2, got {self.sliding_window!r}",
                    "set train.draft.sliding_window to the number of positions the drafter attends (e.g. 2048)",
                )
            if not self.layer.windowed:
                raise UsageError(
                    f"drafter config: a sliding window applies to architecture llama, not {self.architecture}",
                    "remove train.draft.sliding_window",
                )
        if self.hidden_act != "silu":
            raise UsageError(f"drafter config: hidden_act '{self.hidden_act}' is not supported", "use 'silu'")

    @property
    def layer(self) -> Eagle3LayerKind:
        """Its decoder layer's kind (``LAYERS``): what the model, the checks and the forms on disk take from it."""
        return LAYERS[self.architecture]

    @property
    def llama_heads(self) -> tuple[int, int]:
        """(num_key_value_heads, head_dim) of a ``llama`` drafter, which has both (checked on construction)."""
        if self.num_key_value_heads is None or self.head_dim is None:
            raise ValueError(f"an {self.architecture} drafter has no num_key_value_heads/head_dim")
        return self.num_key_value_heads, self.head_dim

    @property
    def mla_shape(self) -> MLAShape:
        """The latent-attention widths of an ``mla`` drafter, which has them all (checked on construction)."""
        kv, nope, rope, v = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if kv is None or nope is None or rope is None or v is None:
            raise ValueError(f"a {self.architecture} drafter has no latent-attention widths")
        return MLAShape(self.q_lora_rank, kv, nope, rope, v)

    @classmethod
    def from_target_config(
        cls, hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int] | None = None, **overrides: Any
    ) -> DrafterConfig:
        """Derive a drafter config from a HF Llama/Qwen/DeepSeek-style target config.

        The drafter copies the target's layer shapes, RoPE and max_position_embeddings (a drafter
        served with another max_position_embeddings than it was trained with loses acceptance).
        ``overrides`` replace fields (None values are ignored). For ``architecture: llama``, overriding
        hidden_size or the head count without head_dim recomputes head_dim = hidden_size // num_attention_heads.
        For ``architecture: mla`` the latent-attention shapes are the target's when it has them (DeepSeek-V3,
        Kimi-K2), else DeepSeek-V3's proportions of the target's head width d: nope d, rope d/2, v d,
        kv_lora_rank 4d, q_lora_rank 12d. q_lora_rank is always set (a target without q compression, such as
        DeepSeek-V2-Lite, gets 12 x qk_nope_head_dim): vLLM's and SGLang's MLA drafters load only that layout.
        """
        tc = text_config(hf_config)

        def need(name: str) -> int:
            if getattr(tc, name, None) is None:
                raise UsageError(
                    f"the target's config has no '{name}'",
                    "eaglekit derives the drafter from a Llama/Qwen/DeepSeek-style decoder config; "
                    "for a drafter shape (e.g. intermediate_size) set it under train.draft",
                )
            return int(getattr(tc, name))

        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(
                f"unknown drafter config override(s): {unknown}",
                f"use only fields of DrafterConfig: {sorted(f.name for f in dataclasses.fields(cls))}",
            )
        n_layers = need("num_hidden_layers")
        if aux_layer_ids is None:
            aux_layer_ids = [2, n_layers // 2, n_layers - 3]
        bad = [i for i in aux_layer_ids if not 0 <= int(i) <= n_layers]
        if bad:
            raise UsageError(
                f"aux layer ids {bad} are outside 0..{n_layers} (the target has {n_layers} layers; "
                "ids are HF hidden_states indices, 0 = embeddings)",
                "fix target.aux_layers",
            )
        heads, hidden = need("num_attention_heads"), need("hidden_size")
        theta, scaling = rope_from_config(tc)
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=overrides.get("intermediate_size") or need("intermediate_size"),
            num_attention_heads=heads,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=need("max_position_embeddings"),
            vocab_size=need("vocab_size"),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
        )
        head_width = int(getattr(tc, "head_dim", None) or hidden // heads)
        LAYERS.get(overrides.get("architecture", "llama"), LLAMA_LAYER).target_shapes(fields, tc, overrides, head_width)
        fields.update(overrides)
        return cls(**fields)

    def extra_weights(self) -> dict[str, tuple[int, ...]]:
        """Weights a drafter built on this layer adds to EAGLE-3's, by key and shape (P-EAGLE's mask_hidden)."""
        return {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        unknown, missing = sorted(set(d) - names), sorted(required - set(d))
        if unknown or missing:
            raise UsageError(
                f"drafter config: unknown keys {unknown}, missing keys {missing}",
                "the drafter config was written by another version; re-export it",
            )
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------
# The Llama layer


class Attention(AttentionProjections):
    """Holds the projections; the attention itself is done by the caller (inference cache or TTT). ``width``: the
    input's, 2H for the first layer (embedding and feature), H for the layers above it."""

    def __init__(self, cfg: DrafterConfig, width: int):
        super().__init__()
        h, (n_kv, hd) = cfg.hidden_size, cfg.llama_heads
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, n_kv * hd, bias=False)
        self.v_proj = nn.Linear(width, n_kv * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)


class Eagle3Layer(Eagle3Block):
    """The EAGLE-3 decoder layer with Llama (MHA/GQA) attention, split around the attention (``layers.py``)."""

    self_attn: Attention

    def __init__(self, cfg: DrafterConfig, width: int | None = None):
        super().__init__(cfg)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size if width is None else width)
        self.n_heads, (self.n_kv, self.head_dim) = cfg.num_attention_heads, cfg.llama_heads
        self.v_dim = self.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[..., T, H] inputs -> q [..., T, nH, hd], k and v [..., T, nKV, hd], RoPE applied to q and k."""
        x = self.attention_input(embeds, feature)
        a = self.self_attn
        q = a.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = a.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = a.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3UpperLayer(Eagle3Layer):
    """Layer i >= 1 of a drafter with several: a plain Llama decoder layer over the previous layer's pre-norm output
    h (vLLM ``llama_eagle3.py``, layer_idx >= 1: ``input_layernorm(hidden_states, residual)`` adds the carried
    residual and norms the sum, the attention reads that H-wide norm, the residual is h; no token embedding, and no
    hidden_norm or norm_before_residual, which belong to the first layer). It takes ``qkv`` and ``finish`` with the
    first layer's arguments, so one loop drives the stack; ``embeds`` goes unread."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg, width=cfg.hidden_size)
        del self.hidden_norm

    def attention_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(feature)

    def finish(self, attn: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        h = feature + self.self_attn.o_proj(attn.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------------------------------------------
# The model


class DraftKVCache:
    """Keys and values of positions the drafter has seen, [B, nKV, S, d] each; all rows share one length. This holds
    the first layer's; ``layer(i)`` a further layer's cache, cropped with this one (every layer sees every position)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.upper: list[DraftKVCache] = []

    def layer(self, i: int) -> DraftKVCache:
        """Layer ``i``'s cache (0: this one)."""
        if i == 0:
            return self
        while len(self.upper) < i:
            self.upper.append(DraftKVCache())
        return self.upper[i - 1]

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
        if self.k is not None and self.v is not None and n < self.length:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
        for cache in self.upper:
            cache.crop(n)


class Eagle3LayerKind(Protocol):
    """What an EAGLE-3 drafter takes from the kind of its one decoder layer: Llama (``LLAMA_LAYER``, below) or
    multi-head latent attention (``mla.MLA_LAYER``)."""

    @property
    def windowed(self) -> bool:
        """Whether it attends a sliding window (train.draft.sliding_window)."""
        ...

    @property
    def legacy_architecture(self) -> str:
        """The plain form's config.json architectures[0]."""
        ...

    @property
    def legacy_prefix(self) -> str:
        """The plain form's decoder-layer key prefix."""
        ...

    @property
    def no_speculators(self) -> str | None:
        """Why it has no speculators form (None: it has one)."""
        ...

    def check(self, cfg: DrafterConfig, positive: Callable[..., None]) -> None:
        """Refuse a config whose layer shape this kind cannot build."""
        ...

    def target_shapes(self, fields: dict[str, Any], tc: Any, overrides: dict[str, Any], head_width: int) -> None:
        """Its layer's widths in ``fields``, from the target's text config ``tc`` (``overrides`` as given)."""
        ...

    def reads_layer(self, layer: dict) -> bool:
        """Whether a checkpoint's layer config (config.json, or its transformer_layer_config) is of this kind."""
        ...

    def fields_from_layer(self, layer: dict, need: Callable[[str], Any]) -> dict[str, Any]:
        """The DrafterConfig fields of its kind read from a checkpoint's layer config (``need``: a key that must
        be there)."""
        ...

    def build(self, cfg: DrafterConfig) -> tuple[Eagle3Layer | MLALayer, Rotary]: ...

    def key_value_elements(self, cfg: DrafterConfig) -> int:
        """Elements of one position's key and value, as the layer makes them."""
        ...

    def attention_shapes(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        """Projection name -> weight shape of its attention (``self_attn.NAME.weight``)."""
        ...

    def layer_config(self, cfg: DrafterConfig) -> dict[str, Any]:
        """The config.json keys that shape its layer (both forms)."""
        ...

    def serving_problems(self, cfg: DrafterConfig) -> list[str]:
        """What keeps both engines from loading it at all."""
        ...

    def fused_a_split(self, cfg: DrafterConfig) -> tuple[int, int] | None:
        """The rows of a fused down-projection the engines may write, split as (q, kv); None: it has none."""
        ...


class LlamaLayerKind:
    """A Llama decoder layer (MHA/GQA), served as vLLM's and SGLang's ``LlamaForCausalLMEagle3``."""

    windowed = True
    legacy_architecture = "LlamaForCausalLMEagle3"
    legacy_prefix = "midlayer."
    no_speculators: str | None = None

    def check(self, cfg: DrafterConfig, positive: Callable[..., None]) -> None:
        positive("num_key_value_heads", "head_dim")
        n_kv, head_dim = cfg.llama_heads
        stray = [n for n in MLA_FIELDS if getattr(cfg, n) is not None]
        if stray:
            raise UsageError(
                f"drafter config: {stray} apply to architecture mla, this drafter is llama",
                "remove them, or set train.draft.architecture: mla",
            )
        if cfg.num_attention_heads % n_kv:
            raise UsageError(
                f"drafter config: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})",
                "pick a divisor of num_attention_heads for num_key_value_heads",
            )
        if head_dim % 2:
            raise UsageError(f"drafter config: head_dim must be even for RoPE, got {head_dim}", "use an even head_dim")

    def target_shapes(self, fields: dict[str, Any], tc: Any, overrides: dict[str, Any], head_width: int) -> None:
        heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
        fields.update(num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads), head_dim=head_width)
        if ("hidden_size" in overrides or "num_attention_heads" in overrides) and "head_dim" not in overrides:
            overrides["head_dim"] = overrides.get("hidden_size", hidden) // overrides.get("num_attention_heads", heads)

    def reads_layer(self, layer: dict) -> bool:
        return True  # the plain layer: any config no other kind claims

    def fields_from_layer(self, layer: dict, need: Callable[[str], Any]) -> dict[str, Any]:
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        return {
            "architecture": "llama",
            "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
            "head_dim": int(layer.get("head_dim") or hidden // heads),
        }

    def build(self, cfg: DrafterConfig) -> tuple[Eagle3Layer, Rotary]:
        return Eagle3Layer(cfg), Rotary(*rope_inv_freq(cfg))

    def key_value_elements(self, cfg: DrafterConfig) -> int:
        n_kv, head_dim = cfg.llama_heads
        return 2 * n_kv * head_dim

    def attention_shapes(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        h2, n = 2 * cfg.hidden_size, cfg.num_attention_heads
        n_kv, head_dim = cfg.llama_heads
        q_width, kv_width = n * head_dim, n_kv * head_dim
        return {
            "q_proj": (q_width, h2),
            "k_proj": (kv_width, h2),
            "v_proj": (kv_width, h2),
            "o_proj": (cfg.hidden_size, q_width),
        }

    def layer_config(self, cfg: DrafterConfig) -> dict[str, Any]:
        return {
            "model_type": "llama",
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "mlp_bias": False,
        }

    def serving_problems(self, cfg: DrafterConfig) -> list[str]:
        return []

    def fused_a_split(self, cfg: DrafterConfig) -> tuple[int, int] | None:
        return None


LLAMA_LAYER = LlamaLayerKind()
LAYERS: dict[str, Eagle3LayerKind] = {"llama": LLAMA_LAYER, "mla": MLA_LAYER}  # train.draft.architecture


class Eagle3Drafter(nn.Module):
    midlayer: Eagle3Layer | MLALayer
    upper_layers: nn.ModuleList  # of Eagle3UpperLayer; empty with one layer (no keys, the state dict unchanged)
    d2t: torch.Tensor  # buffers (register_buffer), declared so that their type is known
    t2d: torch.Tensor

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        ht, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = RMSNorm(3 * ht, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(ht, eps) for _ in range(3)]) if cfg.fc_norm else None
        self.fc = nn.Linear(3 * ht, cfg.hidden_size, bias=False)
        self.midlayer, self.rotary = cfg.layer.build(cfg)
        self.upper_layers = nn.ModuleList([Eagle3UpperLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(cfg.hidden_size, eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_d2t_t2d(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*Ht] concatenated aux hidden states of the target -> the fused feature [B, T, H]."""
        if aux_hidden.shape[-1] != self.fc.in_features:
            raise UsageError(
                f"aux hidden states have width {aux_hidden.shape[-1]}, the drafter's fc expects "
                f"{self.fc.in_features} (3 x target hidden size {self.config.target_hidden_size})",
                "capture exactly three aux layers of the target this drafter was built for",
            )
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            aux_hidden = torch.cat(
                [norm(x) for norm, x in zip(self.fc_norm, aux_hidden.chunk(3, dim=-1), strict=False)], dim=-1
            )
        return self.fc(aux_hidden)

    def draft_step_input(self, previous: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A training-time-test draft step's (token embeddings, feature) for its chains: the next ground-truth
        tokens, and the previous step's output as drafting feeds it back (``next_feature``). P-EAGLE's slots
        override it."""
        with torch.no_grad():
            embeds = self.embed_tokens(next_ids)
        return embeds, self.next_feature(previous)

    @property
    def decoder_layers(self) -> list[Eagle3Layer | MLALayer]:
        """Every decoder layer, first to last (each takes ``qkv(embeds, h, cos, sin)`` and ``finish(attn, h)``)."""
        return [self.midlayer, *self.upper_layers]

    def next_feature(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """What a next draft step takes as its feature: the layer's pre-norm output, or its norm (norm_output)."""
        return self.norm(hidden_out) if self.config.norm_output else hidden_out

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass: (logits [B, T, Vd], the next steps' feature [B, T, H]).

        ``hidden`` is the fused target feature at each position (or the drafter's own previous
        feature output) and ``input_ids`` the token that follows that position. With a cache, the new
        keys/values are appended and attention is causal over cache + new positions.
        """
        cos, sin = self.rotary(position_ids, hidden.dtype)
        embeds = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.decoder_layers):
            q, k, v = layer.qkv(embeds, hidden, cos, sin)
            attn = self._attend(layer, q, k, v, None if cache is None else cache.layer(i))
            hidden = layer.finish(attn.transpose(1, 2), hidden)
        return self.lm_head(self.norm(hidden)), self.next_feature(hidden)

    def _attend(
        self,
        layer: Eagle3Layer | MLALayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: DraftKVCache | None,
    ) -> torch.Tensor:
        """One layer's attention of q [B, T, nH, d] over its cache and the new k, v (appended): [B, nH, T, dv]."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, d]
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        groups = layer.n_heads // layer.n_kv
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        window = self.config.sliding_window
        if past == 0 and window is None:
            return sdpa(q, k, v, layer.scale, is_causal=True)
        # cache slot s holds position s: query past + i sees slots past + i - window < s <= past + i
        t_new, s = q.shape[2], k.shape[2]
        offset = torch.arange(s, device=q.device)[None, :] - (past + torch.arange(t_new, device=q.device))[:, None]
        mask = (offset <= 0) if window is None else (offset <= 0) & (offset > -window)
        return sdpa(q, k, v, layer.scale, attn_mask=mask)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def attention_scale(self) -> float:
        return self.midlayer.scale

"""The DFlash block drafter: a few Qwen3-style layers that propose a whole block of tokens in one pass.

Read from vLLM 0.32 (``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``) and speculators 0.9.0
(``models/dflash``). One forward pass drafts a block:

    context  c_j = hidden_norm(fc(cat(aux states of the target at position j)))        j < n (all verified tokens)
    queries  [bonus token, mask, mask, ...]  at positions n, n+1, ..., n+K           (embedded by the target's table)
    layer    x = input_layernorm(h); q from x; keys/values from [c ; x] (each layer projects c with its own
             k_proj/v_proj, then k_norm and RoPE at the context positions); every query sees every context
             position and every query of its block (non-causal); h += o_proj(attn); h += mlp(post_norm(h))
    drafts   lm_head(norm(h)) at the K mask slots: the mask at position n+i proposes the token at n+i

The context feeds keys and values only; it is never a query and never goes through the layers, so serving
caches its keys/values once per verified token (vLLM's ``precompute_and_store_context_kv``).

A sliding window (``sliding_window`` W) limits every layer to the keys at most W-1 positions before the query
*and makes the block causal*: the query at position p sees the context and the block's keys at positions
p-W+1 .. p. That is how both engines serve a DFlash layer whose ``layer_types`` entry is "sliding_attention":
vLLM 0.32's ``qwen3_dflash._resolve_layer_attention`` gives it ``per_layer_sliding_window = sliding_window`` and
``_dflash_layer_causal`` makes it causal (its CPU kernel, probed, masks 0 <= p - k < W); SGLang's
``models/dflash.py`` gives it ``AttentionType.DECODER`` with ``window_left = sliding_window - 1``
(``dflash_utils.get_dflash_attention_sliding_window_size``). Without a window the block is non-causal, as above.

Parameter names are vLLM's checkpoint keys (``DFlashQwen3ForCausalLM.load_weights`` prefixes ``model.``; q/k/v
and gate/up are stacked by its ``hf_to_vllm_mapper``), so ``state_dict()`` minus the shared tensors is the export:

    fc.weight                                   [H, len(aux) * Ht]
    hidden_norm.weight, norm.weight             [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight  [nH*d, H], [nKV*d, H], [nKV*d, H], [H, nH*d]
    layers.{i}.self_attn.{q,k}_norm.weight      [d]
    layers.{i}.mlp.{gate,up,down}_proj.weight   [I, H], [I, H], [H, I]
    layers.{i}.{input,post_attention}_layernorm.weight  [H]
    embed_tokens.weight, lm_head.weight         the target's, frozen and not exported: vLLM shares both from the
                                                target when the checkpoint has none (the full verifier vocabulary)

``aux_layer_ids`` are HF hidden_states indices (the input of decoder layer i), the same taps as EAGLE-3, so
online features and offline shards serve both families; vLLM's ``dflash_config.target_layer_ids`` name layer
outputs, one less (``checkpoint.py`` converts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.config import DFlashDraft, RunConfig
from eaglekit.data.chat import load_tokenizer
from eaglekit.errors import UsageError
from eaglekit.model.layers import MLP, RMSNorm, Rotary, apply_rope, repeat_kv, rope_inv_freq
from eaglekit.model.target import rope_from_config, text_config
from eaglekit.resolved import ResolvedRun

DEFAULT_LAYERS = 5  # speculators 0.9.0's DFlash recipe (5 layers, block 16, CE with D-PACE)
DEFAULT_BLOCK_SIZE = 16


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int  # draft layers
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the target's: DFlash drafts over the full verifier vocabulary
    target_hidden_size: int
    aux_layer_ids: list[int]  # HF hidden_states indices of the target (module docstring)
    block_size: int  # anchor + block_size - 1 mask slots in training; serving drafts up to block_size - 1
    mask_token_id: int
    # one k_norm weight for every layer: what vLLM 0.32's CPU build serves correctly (``dflash_checkpoint.py``,
    # "The CPU build"); a GPU engine applies each layer's own
    shared_k_norm: bool = False
    # every layer attends the keys at most sliding_window - 1 positions before its query, causally (module docstring)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            self._positive(name)
        self._positive("num_hidden_layers")
        if self.block_size < 2:
            raise UsageError(
                f"dflash: block_size must be at least 2 (the anchor and one mask slot), got {self.block_size}",
                "set train.draft.block_size (speculators' default is 16)",
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UsageError(
                f"dflash: mask_token_id {self.mask_token_id} is outside the target's vocabulary [0, {self.vocab_size})",
                "set train.draft.mask_token_id to a token id of the target (an unused or pad token)",
            )
        if not self.aux_layer_ids:
            raise UsageError("dflash: no aux_layer_ids", "set target.aux_layers")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise UsageError(
                f"dflash: 'sliding_window' must be an integer of at least 2, got {window!r}",
                "set train.draft.sliding_window to the number of positions the drafter attends (e.g. 2048)",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(
                f"dflash: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                "pick a divisor of num_attention_heads for train.draft.num_key_value_heads",
            )

    @property
    def llama_heads(self) -> tuple[int, int]:
        """(num_key_value_heads, head_dim): the layers' attention is Llama/Qwen3-style GQA (``drafter.rope_inv_freq``
        reads this, as for an EAGLE-3 llama layer)."""
        return self.num_key_value_heads, self.head_dim

    def _positive(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"dflash: '{name}' must be a positive integer, got {value!r}", f"fix train.draft.{name}")

    @classmethod
    def from_target_config(
        cls,
        hf_config: Any,
        aux_layer_ids: list[int],
        mask_token_id: int,
        num_hidden_layers: int | None = None,
        block_size: int | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """The target's layer shapes and RoPE (the drafter shares its embedding and head), DFlash's depth and block."""
        tc = text_config(hf_config)
        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"dflash: unknown drafter override(s) {unknown}", "remove them from train.draft")
        theta, scaling = rope_from_config(tc)
        heads = int(overrides.get("num_attention_heads", tc.num_attention_heads))
        hidden = int(overrides.get("hidden_size", tc.hidden_size))
        values: dict[str, Any] = {
            "hidden_size": hidden,
            "intermediate_size": int(tc.intermediate_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(tc, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(tc, "head_dim", None) or hidden // heads),
            "num_hidden_layers": num_hidden_layers or DEFAULT_LAYERS,
            "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": int(tc.max_position_embeddings),
            "vocab_size": int(tc.vocab_size),
            "target_hidden_size": int(tc.hidden_size),
            "aux_layer_ids": [int(i) for i in aux_layer_ids],
            "block_size": block_size or DEFAULT_BLOCK_SIZE,
            "mask_token_id": int(mask_token_id),
        }
        values.update(overrides)
        if values["hidden_size"] != values["target_hidden_size"]:
            raise UsageError(
                f"dflash: hidden_size {values['hidden_size']} differs from the target's {values['target_hidden_size']}",
                "remove train.draft.hidden_size: the drafter embeds with the target's table and drafts with its head",
            )
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def default_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """speculators' choice without adding a token: the tokenizer's mask token, else pad, else eos.

    The mask embedding is the target's (frozen) row of that id; any id works as long as training and serving agree
    (export writes it to ``dflash_config.mask_token_id``).
    """
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < vocab_size:
            return int(value)
    raise UsageError(
        "dflash: the tokenizer has no mask, pad, eos or unk token to use as the mask token",
        "set train.draft.mask_token_id to an id of the target's vocabulary",
    )


def config_for_run(cfg: RunConfig, hf_config: Any, aux_layer_ids: list[int], vocab_size: int) -> DFlashConfig:
    """The DFlash drafter a run's ``train.draft`` asks for, from the target's config (and its tokenizer for the
    mask token when ``mask_token_id`` is unset)."""
    draft = cfg.train.draft_as(DFlashDraft)
    mask = draft.mask_token_id
    if mask is None:
        tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
        mask = default_mask_token_id(tokenizer, vocab_size)
    return DFlashConfig.from_target_config(
        hf_config,
        aux_layer_ids,
        mask,
        num_hidden_layers=draft.num_layers,
        block_size=draft.block_size,
        shared_k_norm=bool(draft.shared_k_norm),
        intermediate_size=draft.intermediate_size,
        num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=draft.head_dim,
        sliding_window=ResolvedRun(cfg).window.window,  # auto resolved
    )


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: fp32 from bf16 or fp32, fp64 kept (a drafter in fp64 is checked at fp64 tolerance)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, Q] and [B, K] positions -> [B, Q, K] bool: the key is at most ``window`` - 1 positions before the query
    (itself included), the causal sliding window both engines apply to a sliding DFlash layer (module docstring)."""
    # two comparisons rather than the difference: an int64 [B, Q, K] offset is 8 bytes per (query, key) pair, 4.8 GB
    # at 8,192 queries over a 65,536-token row
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    return (k <= q) & (k > q - window)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool (True: may attend) -> the [B, 1, Q, K] bias SDPA makes of it (0 or -inf in the query's dtype).

    Made once for all layers: given the bool mask, every layer's SDPA converts it again and keeps its own copy for
    backward, a [Q, K] tensor per layer (1.2 GB each in bf16 at 8,192 queries over a 65,536-token row). Its rows
    are laid out 16-aligned, as CUDA's memory-efficient kernel needs them (else it pads a copy on every call)."""
    keys = mask.shape[-1]
    aligned = -(-keys // 16) * 16
    bias = torch.zeros(*mask.shape[:-1], aligned, dtype=dtype, device=mask.device)[..., :keys]
    return bias.masked_fill_(~mask, float("-inf"))[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, H] -> RoPE'd keys and values [B, T, nKV, d] (for the context and the queries alike)."""
        shape = (*x.shape[:-1], self.n_kv, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, Q, H] queries; context_kv [B, C, nKV, d] each; mask: ``additive_mask``'s [B, 1, Q, C+Q] or None."""
        q = apply_rope(self.q_norm(self.q_proj(x).view(*x.shape[:-1], self.n_heads, self.head_dim)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context_kv[0], k], dim=1).transpose(1, 2)
        v = torch.cat([context_kv[1], v], dim=1).transpose(1, 2)
        groups = self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            repeat_kv(k, groups),
            repeat_kv(v, groups),
            attn_mask=mask,
            scale=self.head_dim**-0.5,
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, context_kv, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The block drafter; ``embed_tokens`` and ``lm_head`` are the target's, frozen (module docstring)."""

    family = "dflash"
    first_drafting_slot = 1  # the anchor slot holds the bonus token; the mask slots sit at what they predict
    layer_class: type[DFlashLayer] = DFlashLayer  # DFlash2's layers add convolutions (drafters/dflash2/model.py)

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.attentions: list[DFlashAttention] = [layer.self_attn for layer in self.layers]  # type: ignore[misc]
        if cfg.shared_k_norm:
            for attention in self.attentions[1:]:
                attention.k_norm.weight = self.attentions[0].k_norm.weight
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        for shared in (self.embed_tokens.weight, self.lm_head.weight):
            shared.requires_grad_(False)
        # normal(0, 0.02) as EAGLE-3's layer and speculators' DFlash start (HF's initializer_range), not torch's
        # fan-in uniform: the race against speculators' trainer measured the difference
        # (benchmarks/results/block-drafters.md, "DFlash's trainer")
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        # the target's RoPE, computed as EAGLE-3's layer computes it (it reads only the fields both configs share)
        self.rotary = Rotary(*rope_inv_freq(cfg))

    def take_target(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Copy in the target's embedding table and lm_head (both [V, H])."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight))
            self.lm_head.weight.copy_(head.to(self.lm_head.weight))

    def slot_bias(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """What a slot's logits add, given the token before it (DSpark's Markov bias); DFlash adds nothing."""
        return None

    def extra_slot_loss(
        self, logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """A loss per block slot [B, A, bs] the block objective adds to its own (DFlash2's selector), given the
        slots' logits [B, A, bs, V], normed hidden states [B, A, bs, H], labels [B, A, bs] and the anchors' tokens
        [B, A]; DFlash adds none."""
        return None

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [..., len(aux)*Ht] -> the context features [..., H] the layers read keys/values from."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: the context's keys and values at ``positions`` [B, C] (what vLLM writes to its KV cache)."""
        cos, sin = self.rotary(positions, context.dtype)
        return [attention.keys_values(context, cos, sin) for attention in self.attentions]

    def forward(
        self,
        query_ids: torch.Tensor,
        query_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query_ids/positions [B, Q] -> logits [B, Q, V] (fp32, or fp64 in fp64). ``mask`` [B, Q, C+Q] None: every query sees
        everything; a sliding window narrows it further, by the context's positions [B, C] (required then)."""
        return self.logits(self.final_hidden(query_ids, query_positions, context_kv, mask, context_positions))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits of ``final_hidden``'s states (fp32, or fp64 in fp64)."""
        return at_least_fp32(self.lm_head(hidden))

    def final_hidden(
        self,
        query_ids: torch.Tensor,
        query_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward``'s normed hidden states [B, Q, H], which the head (and DFlash2's selector) reads."""
        window = self.config.sliding_window
        if window is not None:
            if context_positions is None:
                raise ValueError("a windowed DFlash drafter needs the context's positions")
            keys = torch.cat([context_positions.expand(query_positions.shape[0], -1), query_positions], dim=1)
            windowed = window_mask(query_positions, keys.to(query_positions.device), window)
            mask = windowed if mask is None else mask & windowed
        h = self.embed_tokens(query_ids)
        if mask is not None:
            device = h.device.type
            autocast = torch.is_autocast_enabled(device)
            mask = additive_mask(mask, torch.get_autocast_dtype(device) if autocast else h.dtype)
        cos, sin = self.rotary(query_positions, h.dtype)
        for layer, kv in zip(self.layers, context_kv, strict=True):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

"""Fused attention for the TTT step on GPUs; ``training/ttt.py`` keeps the reference it is tested against.

Two attentions make up a TTT step (see ttt.py):
  - step 0: causal attention over [B, L] (per document when rows are packed);
  - step k >= 1: chain f attends the step-0 keys of its document up to f, plus the keys steps 1..k made at
    chain f itself (one each).

Unpacked step 0 is ``scaled_dot_product_attention`` with ``is_causal`` (FlashAttention on a GPU). Everything
else is one "span" attention: query row i attends the keys lo[i]..hi[i] of a flat key list, plus, for each
earlier draft step s, the key extra_k[s, i]. The extra keys are appended after the step-0 keys, so one flex
attention call covers the whole softmax (no log-sum-exp merge, no gradient through a log-sum-exp) and its
block mask skips every block outside a row block's span and its diagonals: no L x L matrix, neither in forward
nor in backward. Packed step 0 is the same call with hi[i] = i and no extra keys.

Flex attention runs fused only when compiled (``torch.compile`` generates its Triton kernels); eager it runs a
dense reference, and on the CPU it has no backward. ``span_mask`` is the one definition of which keys a row
sees, so the CPU tests check it (as a dense mask) against ttt.py's reference with gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from eaglekit.model.layers import sdpa


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, L, nH, hd], k [B, L, nKV, hd], v [B, L, nKV, dv] -> [B, L, nH, dv]; GQA without repeating k and v."""
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def span_mask(lo: torch.Tensor, hi: torch.Tensor, n_prefix: int) -> Callable:
    """Flex attention's mask_mod: query i sees keys lo[i]..hi[i] (< n_prefix) and the appended keys
    n_prefix + s * N + i for every earlier step s (N = lo's length)."""
    n = lo.shape[0]

    def visible(b, h, q_idx, kv_idx):
        in_span = (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])
        own = (kv_idx >= n_prefix) & ((kv_idx - n_prefix) % n == q_idx)
        return in_span | own

    return visible


def span_keys(
    k0: torch.Tensor, v0: torch.Tensor, extra_k: torch.Tensor | None, extra_v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat key and value lists span_mask indexes: k0 [S, nKV, d], then extra_k [steps, N, nKV, d] step by step."""
    if extra_k is None or extra_v is None:
        return k0, v0
    return torch.cat([k0, extra_k.flatten(0, 1)]), torch.cat([v0, extra_v.flatten(0, 1)])


@functools.cache
def _flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention  # lazy: optional (torch < 2.5 lacks it)

    # dynamic: the number of rows changes with every step and batch; a recompile per shape would hit dynamo's
    # recompile limit within a few batches and fall back to the dense eager version
    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def span_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    extra_k: torch.Tensor | None = None,
    extra_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, nH, hd] over span_keys(k0, v0, extra_k, extra_v) as span_mask says -> [N, nH, dv], by flex attention.

    Every row must see at least one key (hi[i] >= lo[i]), as every TTT row sees itself.
    """
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: optional (torch < 2.5 lacks it)

    n, n_heads, hd = q.shape
    keys, values = span_keys(k0, v0, extra_k, extra_v)
    dv = values.shape[-1]
    if n == 0:
        return q.new_zeros(0, n_heads, dv)
    if dv != hd:  # MLA: one head width for the kernel; zeros change neither the scores nor the first dv columns
        width = max(dv, hd)
        q, keys, values = F.pad(q, (0, width - hd)), F.pad(keys, (0, width - hd)), F.pad(values, (0, width - dv))
    mask = span_mask(lo, hi, k0.shape[0])
    block_mask = create_block_mask(mask, None, None, n, keys.shape[0], device=q.device, _compile=q.is_cuda)
    out = _flex(q.device.type)(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=n_heads != keys.shape[1],
    )
    return out[0].transpose(0, 1)[..., :dv]

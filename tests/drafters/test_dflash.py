"""The DFlash block drafter's own parts: its attention pattern, its D-PACE position weights, its config's refusals,
and the k_norm kernel of vLLM 0.32's CPU build that shared_k_norm answers. What every block family does (training,
decoding, the export's key contract with vLLM's loader, `eaglekit run`) is tested in tests/drafters/test_families.py."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.objective import block_attention_mask, document_ids, position_weights
from eaglekit.errors import UsageError

BLOCK = 4


def test_block_attention_sees_its_document_before_the_anchor_and_its_own_block():
    # one packed row: document 0 at positions 0-2, document 1 at 3-5, then padding
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 0]])
    docs = document_ids(attention, positions)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, -1]]
    mask = block_attention_mask(docs, torch.tensor([[1, 5]]), block_size=2)[0].int()
    context, blocks = mask[:, :7], mask[:, 7:]
    assert context.tolist() == [[1, 0, 0, 0, 0, 0, 0]] * 2 + [[0, 0, 0, 1, 1, 0, 0]] * 2
    assert blocks.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]  # non-causal, own block only


def test_dpace_weighs_each_slot_by_the_accepted_tokens_that_depend_on_it():
    ce = torch.tensor([[0.0, 0.2, 1.0, 0.5], [0.0, 0.3, 0.1, 2.0]])
    counted = torch.tensor([[False, True, True, True], [False, True, True, False]])
    alpha = 0.5
    got = position_weights(ce, counted, "dpace", alpha, gamma=4.0)
    for row in range(2):
        smooth = [(1 - alpha) * torch.exp(-ce[row, k]).item() + alpha if counted[row, k] else 1.0 for k in range(4)]
        for k in range(4):
            prefix = [torch.tensor(smooth[: m + 1]).prod().item() for m in range(4)]
            want = sum(prefix[m] for m in range(k, 4) if counted[row, m]) if counted[row, k] else 0.0
            assert got[row, k].item() == pytest.approx(want, rel=1e-5)
    decay = position_weights(ce, counted, "exp-decay", alpha, gamma=2.0)
    assert decay[0].tolist() == pytest.approx([0.0, 1.0, torch.exp(torch.tensor(-0.5)).item(), 1 / torch.e])


def test_config_refuses_a_mask_token_outside_the_vocabulary(tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target).config
    with pytest.raises(UsageError, match="mask_token_id 9999"):
        DFlashConfig.from_target_config(hf, [2, 4, 5], mask_token_id=9999)
    with pytest.raises(UsageError, match="block_size"):
        DFlashConfig.from_target_config(hf, [2, 4, 5], mask_token_id=0, block_size=1)


# -------------------------------------------------------------------------------------------- the real vLLM
# Serving in the engine is tested through `eaglekit run` (tests/drafters/test_families.py: verify, one engine start).


KERNEL_PROBE = """
import json, torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
x = torch.randn(2, 3, 2, 8)  # [layers, context tokens, kv heads, head_dim], as _normalize_context_k passes it
w = torch.stack([torch.full((8,), 1.0), torch.full((8,), 2.0)])  # one k_norm weight per layer
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
rows = [next((r for r in range(2) if torch.allclose(out[n], normed[n] * w[r], atol=1e-5)), None) for n in range(2)]
print(json.dumps(rows))
"""


def test_cpu_build_applies_layer_0s_k_norm_to_every_layers_context_keys(vllm_python, tiny_target):
    """Why a DFlash drafter with per-layer k_norm serves with other drafts on vLLM 0.32's CPU build: the grouped
    RMSNorm of ``DFlashQwen3Model._normalize_context_k`` reads row 0 of the stacked weights for every layer. When
    this fails, vLLM has fixed the kernel and ``shared_k_norm`` is no longer needed on the CPU."""
    from eaglekit.drafters.dflash.checkpoint import cpu_build_problem

    probe = subprocess.run([str(vllm_python), "-c", KERNEL_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == [0, 0]  # layer 1 normed with layer 0's weight

    hf = AutoModelForCausalLM.from_pretrained(tiny_target).config
    cfg = DFlashConfig.from_target_config(hf, [2, 4, 5], 0, num_hidden_layers=2, block_size=BLOCK, shared_k_norm=True)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # one k_norm for both layers: what training moves in one, moves in the other
        drafter.layers[0].self_attn.k_norm.weight.uniform_(0.5, 1.5)
    state = {k: v for k, v in drafter.state_dict().items()}
    assert cpu_build_problem(state, drafter.config) is None
    state["layers.1.self_attn.k_norm.weight"] = state["layers.1.self_attn.k_norm.weight"] * 1.5
    assert "layer 0's" in (cpu_build_problem(state, drafter.config) or "")

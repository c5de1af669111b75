"""The DFlash block drafter: its attention pattern and position weights, training on the tiny target, block decoding
as vLLM's proposer does it (lossless at T=0), and the export's key contract with vLLM 0.32's loader."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from block_drafters import heldout_prompts, one_round_two_ways, train_block_drafter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.dflash import DFlashConfig, DFlashDrafter, default_mask_token_id
from eaglekit.model.dflash_checkpoint import expected_state, load_dflash, read_dflash_config, save_dflash
from eaglekit.model.target import default_aux_layers
from eaglekit.speculative.block import BlockProposer
from eaglekit.speculative.decode import generate
from eaglekit.training.block import block_attention_mask, document_ids, position_weights

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


# ------------------------------------------------------------------------------------ trained on the tiny target


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target).eval(), AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def trained(target):
    """A 2-layer, block-4 drafter trained 120 steps (seed 0) on the tiny corpus with online target features; one
    k_norm for both layers, which vLLM's CPU build serves exactly (test_cpu_build_applies_layer_0s_k_norm_...)."""
    model, tok = target
    torch.manual_seed(0)
    aux = default_aux_layers(model.config.num_hidden_layers)
    mask_id = default_mask_token_id(tok, model.config.vocab_size)
    cfg = DFlashConfig.from_target_config(
        model.config, aux, mask_id, num_hidden_layers=2, block_size=BLOCK, shared_k_norm=True
    )
    drafter, taus, _ = train_block_drafter(model, tok, DFlashDrafter(cfg))
    return drafter, taus


def test_training_raises_the_block_acceptance(trained):
    _, taus = trained
    first, last = sum(taus[:10]) / 10, sum(taus[-10:]) / 10
    assert first < 1.3 and last > first + 1.0, (first, last)


@pytest.mark.parametrize("k", [1, BLOCK - 1, BLOCK + 1])
def test_block_decoding_is_lossless_at_t0_and_accepts_drafts(target, trained, k):
    model, tok = target
    drafter, _ = trained
    total = None
    for prompt in heldout_prompts(tok, 4):
        plain = generate(model, prompt, 48)
        spec = generate(model, prompt, 48, proposer=BlockProposer(drafter), k=k)
        assert spec.tokens == plain.tokens
        total = spec.stats if total is None else total + spec.stats
    assert total is not None and len(total.acceptance_by_position()) == k
    assert total.tau > 1 + 0.5 * min(k, BLOCK - 1), total.tau  # drafts are accepted, not just tolerated


def test_block_proposer_drafts_what_one_uncached_forward_drafts(target, trained):
    """The proposer's cached context equals recomputing all of it: a round's drafts depend only on the verified
    tokens' states, as in vLLM, whose cache holds each context position's keys/values once."""
    model, tok = target
    drafter, _ = trained
    prompt = heldout_prompts(tok, 1)[0]
    cached, logits, _ = one_round_two_ways(model, drafter, BlockProposer(drafter), prompt, drafts=3, masks=3)
    assert cached == logits[1:].argmax(-1).tolist()


# ------------------------------------------------------------------------------------------------------- export


def vllm_parameter_names(cfg: DFlashConfig) -> set[str]:
    """What ``DFlashQwen3ForCausalLM.load_weights`` (vLLM 0.32) loads from our names, read from qwen3_dflash.py:
    every name but lm_head gets ``model.``; ``hf_to_vllm_mapper`` stacks q/k/v_proj into qkv_proj and
    gate/up_proj into gate_up_proj; embed_tokens and mask_embedding are dropped when the checkpoint has none
    (the target's are shared); fc is loaded because use_aux_hidden_state defaults to true."""
    names = {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {
            p + "self_attn.qkv_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "self_attn.q_norm.weight",
            p + "self_attn.k_norm.weight",
            p + "mlp.gate_up_proj.weight",
            p + "mlp.down_proj.weight",
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
        }
    return names


def as_vllm_loads_them(keys: set[str]) -> set[str]:
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
    stacked |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}
    out = set()
    for key in keys:
        name = key if "lm_head" in key else "model." + key
        for old, new in stacked.items():
            name = name.replace(old, new)
        out.add(name)
    return out


def test_export_is_the_form_vllm_loads(tmp_path, trained):
    drafter, _ = trained
    cfg = drafter.config
    save_dflash(drafter, tmp_path / "dflash")
    state = load_file(str(tmp_path / "dflash" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_state(cfg)
    assert as_vllm_loads_them(set(state)) == vllm_parameter_names(cfg)
    assert not any("mask_hidden" in k or "embed_tokens" in k or "lm_head" in k for k in state)
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # vLLM's aux-hidden-state ids are target_layer_ids + 1 (eagle3_utils.get_eagle3_aux_layers_from_config)
    assert [i + 1 for i in config["dflash_config"]["target_layer_ids"]] == cfg.aux_layer_ids
    assert config["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert "layer_types" not in config and "use_swa" not in config["dflash_config"]  # all full, non-causal
    assert config["target_hidden_size"] * len(cfg.aux_layer_ids) == state["fc.weight"].shape[1]


def test_reimported_drafter_drafts_the_same(tmp_path, target, trained):
    model, tok = target
    drafter, _ = trained
    save_dflash(drafter, tmp_path / "dflash")
    (tmp_path / "dflash" / "eaglekit.json").unlink()  # re-import from vLLM's config.json alone
    assert dataclasses.replace(read_dflash_config(tmp_path / "dflash"), shared_k_norm=True) == drafter.config
    again = load_dflash(tmp_path / "dflash", model.get_input_embeddings().weight, model.lm_head.weight).eval()
    assert again.config == drafter.config  # shared_k_norm read back from the equal weights
    for prompt in heldout_prompts(tok, 2):
        a = generate(model, prompt, 32, proposer=BlockProposer(drafter), k=3)
        b = generate(model, prompt, 32, proposer=BlockProposer(again), k=3)
        assert a.accepted_per_round == b.accepted_per_round


def test_a_checkpoint_that_lost_a_key_is_refused_by_name(tmp_path, target, trained):
    model, _ = target
    drafter, _ = trained
    save_dflash(drafter, tmp_path / "dflash")
    weights = tmp_path / "dflash" / "model.safetensors"
    state = load_file(str(weights))
    del state["layers.1.self_attn.k_norm.weight"]
    save_file(state, str(weights))
    with pytest.raises(EaglekitError, match=r"missing key layers\.1\.self_attn\.k_norm\.weight"):
        load_dflash(tmp_path / "dflash", model.get_input_embeddings().weight, model.lm_head.weight)


# -------------------------------------------------------------------------------------------- the real vLLM
# Serving in the engine is tested through `eaglekit run` (tests/test_dflash_run.py: verify, one engine start).


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


def test_cpu_build_applies_layer_0s_k_norm_to_every_layers_context_keys(vllm_python, trained):
    """Why a DFlash drafter with per-layer k_norm serves with other drafts on vLLM 0.32's CPU build: the grouped
    RMSNorm of ``DFlashQwen3Model._normalize_context_k`` reads row 0 of the stacked weights for every layer. When
    this fails, vLLM has fixed the kernel and ``shared_k_norm`` is no longer needed on the CPU."""
    from eaglekit.model.dflash_checkpoint import cpu_build_problem

    probe = subprocess.run([str(vllm_python), "-c", KERNEL_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == [0, 0]  # layer 1 normed with layer 0's weight

    drafter, _ = trained
    state = {k: v for k, v in drafter.state_dict().items()}
    assert cpu_build_problem(state, drafter.config) is None
    state["layers.1.self_attn.k_norm.weight"] = state["layers.1.self_attn.k_norm.weight"] * 1.5
    assert "layer 0's" in (cpu_build_problem(state, drafter.config) or "")

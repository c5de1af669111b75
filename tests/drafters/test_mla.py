"""The MLA drafter layer against transformers' DeepSeek-V3 attention, and its config derived from targets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.errors import UsageError
from eaglekit.model.layers import sdpa

YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def deepseek_target(**kw) -> DeepseekV3Config:
    base = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    base.update(kw)
    return DeepseekV3Config(**base)


@pytest.mark.parametrize("q_lora_rank, rope_scaling", [(24, YARN), (None, None)])
def test_mla_layer_matches_transformers_deepseek_v3_attention(q_lora_rank, rope_scaling):
    """q/k/v, interleaved RoPE, YaRN tables and softmax scale give the attention of transformers' DeepSeek-V3."""
    target = deepseek_target(q_lora_rank=q_lora_rank, rope_scaling=rope_scaling)
    cfg = DrafterConfig.from_target_config(target, draft_vocab_size=20, architecture="mla", q_lora_rank=q_lora_rank)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        q_lora_rank or 96,
        16,
        8,
        4,
        6,
    )
    if q_lora_rank is None:  # published drafters may have one q_proj: the layer supports it
        cfg = dataclasses.replace(cfg, q_lora_rank=None)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).double()
    layer = drafter.midlayer
    # transformers' attention over our 2H-wide input: a DeepSeek-V3 layer of hidden size 2H with our weights,
    # its o_proj padded so the first H outputs are ours.
    hf_cfg = deepseek_target(q_lora_rank=q_lora_rank, rope_scaling=rope_scaling, hidden_size=2 * cfg.hidden_size)
    hf_cfg._attn_implementation = "sdpa"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).double().eval()
    ours = dict(layer.self_attn.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "o_proj.weight":
                p.zero_()[: cfg.hidden_size] = ours[name]
            elif name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
                ours[name].copy_(p)
            else:
                p.copy_(ours[name])
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(2, 9, cfg.hidden_size, generator=g, dtype=torch.float64)
    feature = torch.randn(2, 9, cfg.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.arange(100, 109)[None].expand(2, 9)  # past original_max_position_embeddings: YaRN matters

    cos, sin = drafter.rotary(positions, torch.float64)
    q, k, v = layer.qkv(embeds, feature, cos, sin)
    attn = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layer.scale, is_causal=True)
    got = layer.self_attn.o_proj(attn.transpose(1, 2).flatten(-2))
    with torch.no_grad():
        hf_pos = DeepseekV3RotaryEmbedding(hf_cfg)(embeds, positions)
        want, _ = hf(layer.attention_input(embeds, feature), position_embeddings=hf_pos, attention_mask=None)
    assert layer.scale == pytest.approx(hf.scaling, rel=1e-12)
    assert drafter.rotary.scale == pytest.approx(float(DeepseekV3RotaryEmbedding(hf_cfg).attention_scaling), rel=1e-9)
    torch.testing.assert_close(got, want[..., : cfg.hidden_size], rtol=1e-6, atol=1e-6)
    assert want[..., cfg.hidden_size :].abs().max() == 0


def test_mla_config_from_targets():
    # DeepSeek-V3 / Kimi-K2 shaped: the latent shapes are the target's; llama fields are unused (None).
    cfg = DrafterConfig.from_target_config(deepseek_target(rope_scaling=YARN), 20, architecture="mla")
    assert cfg.architecture == "mla" and cfg.num_key_value_heads is None and cfg.head_dim is None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.max_position_embeddings == 512
    assert cfg.intermediate_size == 48  # the target's dense MLP, not its experts'
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    # train.draft overrides: flags, a narrower latent.
    small = DrafterConfig.from_target_config(
        deepseek_target(), 20, architecture="mla", kv_lora_rank=8, fc_norm=True, norm_output=True
    )
    assert (small.q_lora_rank, small.kv_lora_rank, small.fc_norm, small.norm_output) == (24, 8, True, True)
    # A target without q compression (DeepSeek-V2-Lite): the drafter still gets one, the only layout the engines load.
    assert DrafterConfig.from_target_config(deepseek_target(q_lora_rank=None), 20, architecture="mla").q_lora_rank == 96

    # A Llama target: DeepSeek-V3's proportions of its head width (d = 64 / 4 = 16).
    llama = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=256,
    )
    derived = DrafterConfig.from_target_config(llama, 40, architecture="mla")
    assert (
        derived.q_lora_rank,
        derived.kv_lora_rank,
        derived.qk_nope_head_dim,
        derived.qk_rope_head_dim,
        derived.v_head_dim,
    ) == (192, 64, 16, 8, 16)
    assert DrafterConfig.from_target_config(deepseek_target(), 20).architecture == "llama"  # the default

    with pytest.raises(UsageError, match="apply to architecture llama"):
        DrafterConfig.from_target_config(llama, 40, architecture="mla", head_dim=32)
    with pytest.raises(UsageError, match="norm_before_fc"):
        DrafterConfig.from_target_config(llama, 40, architecture="mla", norm_before_fc=True)
    with pytest.raises(UsageError, match="mutually exclusive"):
        DrafterConfig.from_target_config(llama, 40, fc_norm=True, norm_before_fc=True)
    with pytest.raises(UsageError, match="'moe'"):
        DrafterConfig.from_target_config(llama, 40, architecture="moe")
    llama3 = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        vocab_size=101,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    with pytest.raises(UsageError, match="llama3"):  # vLLM would serve it as DeepSeek YaRN
        DrafterConfig.from_target_config(llama3, 40, architecture="mla")


def test_mla_parameters_are_the_engines_names():
    cfg = DrafterConfig.from_target_config(deepseek_target(), 20, architecture="mla", fc_norm=True)
    shapes = {
        k: tuple(v.shape) for k, v in Eagle3Drafter(cfg).state_dict().items() if k.startswith("midlayer.self_attn")
    }
    h2 = 2 * cfg.hidden_size
    assert shapes == {
        "midlayer.self_attn.q_a_proj.weight": (24, h2),
        "midlayer.self_attn.q_a_layernorm.weight": (24,),
        "midlayer.self_attn.q_b_proj.weight": (4 * (8 + 4), 24),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (16 + 4, h2),
        "midlayer.self_attn.kv_a_layernorm.weight": (16,),
        "midlayer.self_attn.kv_b_proj.weight": (4 * (8 + 6), 16),
        "midlayer.self_attn.o_proj.weight": (cfg.hidden_size, 4 * 6),
    }

"""The two checkpoint forms: round trips, the config fields the servers read, and the key/shape contract."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eaglekit.drafters.eagle3 import checkpoint as ck
from eaglekit.drafters.eagle3.model import FLAGS, DrafterConfig, Eagle3Drafter
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.draft_vocab import build_d2t_t2d


def make_drafter(target_hidden_size=48, aux=(2, 4, 5), rope_scaling=None, seed=0, **kw) -> Eagle3Drafter:
    shape = dict(num_key_value_heads=2, head_dim=8)
    if kw.get("architecture") == "mla":
        shape = dict(
            num_key_value_heads=None,
            head_dim=None,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
        )
    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=256,
        vocab_size=50,
        draft_vocab_size=kw.pop("draft_vocab_size", 20),
        target_hidden_size=target_hidden_size,
        aux_layer_ids=list(aux) if aux is not None else None,
        **{**shape, **kw},
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        selected = (
            torch.randperm(50, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size].sort().values
        )
        d2t, t2d = build_d2t_t2d(selected, 50)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    return drafter


def outputs_of(drafter: Eagle3Drafter, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the next step's feature) on random inputs."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 7, 3 * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        return drafter(ids, drafter.fuse(aux.to(drafter.fc.weight.dtype)), torch.arange(7).expand(2, 7))


def logits_of(drafter: Eagle3Drafter, seed=1) -> torch.Tensor:
    return outputs_of(drafter, seed)[0]


def test_legacy_round_trip(tmp_path):
    drafter = make_drafter()
    ck.save_legacy(drafter, tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    loaded, info = ck.load_drafter(tmp_path / "d")
    assert (info.form, info.missing_embeddings, info.aux_layer_ids) == ("legacy", False, [2, 4, 5])
    assert loaded.config == drafter.config
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)


def test_speculators_round_trip(tmp_path):
    drafter = make_drafter(rope_scaling={"rope_type": "linear", "factor": 2.0})
    warning = ck.save_speculators(drafter, tmp_path / "s", "org/target", ["LlamaForCausalLM"], 3)
    assert warning is None
    keys = set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    loaded, info = ck.load_drafter(tmp_path / "s")
    assert (info.form, info.verifier, info.aux_layer_ids) == ("speculators", "org/target", [2, 4, 5])
    assert loaded.config == drafter.config
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)


def test_legacy_config_is_what_vllm_and_sglang_read(tmp_path):
    drafter = make_drafter(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    )
    ck.save_legacy(drafter, tmp_path / "d", include_embeddings=False)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False  # SGLang ties lm_head to embed if true
    assert (raw["vocab_size"], raw["draft_vocab_size"], raw["hidden_size"], raw["head_dim"]) == (50, 20, 32, 8)
    assert (raw["max_position_embeddings"], raw["rms_norm_eps"], raw["hidden_act"]) == (256, 1e-5, "silu")
    assert raw["rope_theta"] == 500000.0 and raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["target_hidden_size"] == 48
    # vLLM (gpu_model_runner._get_eagle3_aux_layers_from_config) reads the top-level ids as hidden_states indices;
    # SGLang (model_runner + set_eagle3_layers_to_capture) reads eagle_config's, and both of its rules land on them.
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert {tuple(rule(raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"])) for rule in SGLANG_RULES} == {
        (2, 4, 5)
    }
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))

    # Both servers build the draft config with transformers; the fields they use survive that.
    hf = LlamaConfig.from_pretrained(tmp_path / "d")
    assert hf.draft_vocab_size == 20 and hf.target_hidden_size == 48 and hf.head_dim == 8
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["rope_theta"] == 500000.0

    # target_hidden_size only when it differs: the loaders test hasattr(config, "target_hidden_size").
    ck.save_legacy(make_drafter(target_hidden_size=32), tmp_path / "same")
    assert not hasattr(LlamaConfig.from_pretrained(tmp_path / "same"), "target_hidden_size")
    # No pinned aux ids: neither key, so both servers use their (equal) default [2, N//2, N-3].
    ck.save_legacy(make_drafter(aux=None), tmp_path / "default")
    raw = json.loads((tmp_path / "default" / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in raw and "eagle_config" not in raw


def vllm_speculators_to_draft_config(config_dict: dict) -> dict:
    """vLLM's reading of a speculators config: base.py validation + algos.update_eagle3, restated."""
    spec = config_dict["speculators_config"]
    _ = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
    assert isinstance(config_dict["transformer_layer_config"], dict)
    out = dict(config_dict["transformer_layer_config"])
    out["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    if config_dict.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config_dict["target_hidden_size"]
    out["norm_before_residual"] = config_dict.get("norm_before_residual", True)
    out["norm_before_fc"] = config_dict.get("norm_before_fc", False)
    out["fc_norm"] = config_dict.get("fc_norm", False)
    out["norm_output"] = config_dict.get("norm_output", False)
    model_type = out.get("model_type", "llama")
    if model_type not in ("qwen3", "llama"):
        raise ValueError(f"Unsupported model_type {model_type} for Eagle3 speculator")
    if config_dict.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = config_dict["eagle_aux_hidden_state_layer_ids"]
    return out


def test_speculators_config_is_what_vllm_reads(tmp_path):
    ck.save_speculators(make_drafter(), tmp_path / "s", "org/target", ["LlamaForCausalLM"], 5)
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    spec = raw["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    layer = raw["transformer_layer_config"]
    assert (layer["model_type"], layer["vocab_size"], layer["num_hidden_layers"]) == ("llama", 50, 1)
    draft = vllm_speculators_to_draft_config(raw)
    assert draft["norm_before_residual"] is False  # written explicitly: vLLM's default is true
    assert (draft["draft_vocab_size"], draft["target_hidden_size"]) == (20, 48)
    assert draft["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert LlamaConfig(**draft).head_dim == 8


def test_speculators_without_verifier_warns(tmp_path):
    warning = ck.save_speculators(make_drafter(), tmp_path / "s", None, None, 3)
    assert warning and "vllm" in warning.lower() and "verifier" in warning
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] is None
    assert ck.load_drafter(tmp_path / "s")[1].verifier is None


def test_contract_names_missing_extra_and_misshaped_keys(tmp_path):
    drafter = make_drafter()
    cfg = drafter.config
    good = drafter.state_dict()
    ck.validate_state_dict(good, cfg)

    missing = {k: v for k, v in good.items() if k != "midlayer.mlp.up_proj.weight"}
    with pytest.raises(EaglekitError, match="missing key midlayer.mlp.up_proj.weight"):
        ck.validate_state_dict(missing, cfg)
    extra = {**good, "midlayer.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    with pytest.raises(EaglekitError, match="unexpected key midlayer.self_attn.rotary_emb.inv_freq"):
        ck.validate_state_dict(extra, cfg)
    misshaped = {**good, "midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}
    with pytest.raises(
        EaglekitError, match=re.escape("midlayer.self_attn.q_proj.weight has shape [32, 32], expected [32, 64]")
    ):
        ck.validate_state_dict(misshaped, cfg)
    with pytest.raises(EaglekitError, match="d2t has dtype torch.int32"):
        ck.validate_state_dict({**good, "d2t": good["d2t"].int()}, cfg)
    with pytest.raises(EaglekitError, match="t2d does not mark"):
        ck.validate_state_dict({**good, "t2d": torch.ones(50, dtype=torch.bool)}, cfg)
    with pytest.raises(EaglekitError, match="missing key layers.0.norm|missing key layers.0.hidden_norm.weight"):
        ck.validate_state_dict(good, cfg, form="speculators")

    # A checkpoint on disk with a bad key is refused when read, naming the key and the folder.
    ck.save_legacy(drafter, tmp_path / "d")
    save_file({k: v.contiguous() for k, v in misshaped.items()}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(EaglekitError, match=r"q_proj.weight has shape \[32, 32\]") as err:
        ck.load_drafter(tmp_path / "d")
    assert str(tmp_path / "d") in str(err.value)


def test_refused_save_leaves_the_old_checkpoint(tmp_path):
    ck.save_legacy(make_drafter(seed=0), tmp_path / "d")
    before = (tmp_path / "d" / "model.safetensors").read_bytes()
    broken = make_drafter(seed=1)
    broken.lm_head = torch.nn.Linear(32, 21, bias=False)
    with pytest.raises(EaglekitError, match=r"lm_head.weight has shape \[21, 32\]"):
        ck.save_legacy(broken, tmp_path / "d")
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == before


def kimi_style_config(cfg: DrafterConfig) -> dict:
    """Shaped like SpecForge's configs/kimi-k2-eagle3.json: model_type of the target, SGLang aux ids, no head_dim."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": 48,
        "model_type": "kimi_k2",
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
    }


@pytest.mark.parametrize("layout", ["safetensors", "bin", "sharded"])
def test_kimi_style_legacy_checkpoint_loads(tmp_path, layout):
    drafter = make_drafter(target_hidden_size=32).to(torch.bfloat16)  # head_dim 8 = 32 / 4, as the config implies
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(kimi_style_config(drafter.config)))
    torch.save({"optimizer": {"not": "weights"}}, folder / "training_state.pt")
    if layout == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    elif layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        names = sorted(state)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: state[k] for k in keys}, str(folder / file))
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    loaded, info = ck.load_drafter(folder)
    assert info.form == "legacy" and info.missing_embeddings
    assert info.aux_layer_ids == [2, 4, 5]  # SGLang's output-of-layer ids + 1
    assert loaded.fc.weight.dtype == torch.bfloat16
    with torch.no_grad():
        loaded.embed_tokens.weight.copy_(drafter.embed_tokens.weight)  # what train does: the target's embedding
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)


def test_load_refusals(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        ck.load_drafter(tmp_path / "nope")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(UsageError, match="not an EAGLE-3 drafter"):
        ck.load_drafter(target)
    ck.save_speculators(make_drafter(), tmp_path / "s", "org/t", [], 3)
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    del raw["norm_before_residual"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(raw))
    assert ck.load_drafter(tmp_path / "s")[0].config.norm_before_residual is True  # vLLM's reading when absent
    (tmp_path / "s" / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="no model.safetensors"):
        ck.load_drafter(tmp_path / "s")


def test_check_compatible():
    drafter = make_drafter(target_hidden_size=32)
    cfg = drafter.config
    target = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )
    assert ck.check_compatible(cfg, target, [2, 4, 5]) == []
    wider = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )
    problems = ck.check_compatible(cfg, wider, [2, 4, 5])
    assert any(p.startswith("hidden_size") for p in problems)
    assert any(p.startswith("target_hidden_size") and "64" in p for p in problems)
    # None = the servers' default [2, N//2, N-3], here [2, 4, 5]: the drafter's own ids.
    assert ck.check_compatible(cfg, target, None) == []
    problems = ck.check_compatible(cfg, target, [1, 4, 5], tokenizer_vocab_size=51)
    assert problems == [p for p in problems if p.startswith(("aux layers", "vocab_size"))] and len(problems) == 2
    assert "[1, 4, 5]" in problems[-1] and "tokenizer has 51" in problems[0]
    # a long-context target's RoPE scaling the drafter lacks (speculators#574) is named; the target's own is fine
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    scaled = LlamaConfig(**{**target.to_dict(), "rope_parameters": yarn})
    (problem,) = ck.check_compatible(cfg, scaled, [2, 4, 5])
    assert problem.startswith("rope_scaling") and "yarn" in problem
    same = dataclasses.replace(cfg, rope_scaling={k: v for k, v in yarn.items() if k != "rope_theta"})
    assert ck.check_compatible(same, scaled, [2, 4, 5]) == []


# ------------------------------------------------------------------------------------------ EAGLE 3.1 flags

FLAG_SETS = {
    "eagle3.1": dict(fc_norm=True, norm_output=True, norm_before_residual=True),
    "norm_before_fc": dict(norm_before_fc=True),
}


def perturbed_norms(drafter: Eagle3Drafter) -> Eagle3Drafter:
    with torch.no_grad():  # the new norms away from 1, so a weight read into the wrong place shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_eagle31_flags_round_trip_in_both_forms(tmp_path, flags):
    drafter = perturbed_norms(make_drafter(**FLAG_SETS[flags]))
    want = outputs_of(drafter)

    ck.save_legacy(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    keys = load_file(str(tmp_path / "d" / "model.safetensors"))
    # vLLM's llama_eagle3.py reads the flags as attributes of the plain config (norm_before_fc also from eagle_config)
    hf = LlamaConfig.from_pretrained(tmp_path / "d")
    for name in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
        assert raw[name] is getattr(drafter.config, name) and getattr(hf, name) is getattr(drafter.config, name), name
    if drafter.config.fc_norm:  # fc_norm.{i}.weight, one per aux hidden state, target-hidden wide
        assert [tuple(keys[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(48,)] * 3
    if drafter.config.norm_before_fc:  # input_norm.weight over the concatenation
        assert tuple(keys["input_norm.weight"].shape) == (3 * 48,)
    loaded, _ = ck.load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config
    for got, expected in zip(outputs_of(loaded), want, strict=False):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

    ck.save_speculators(drafter, tmp_path / "s", "org/target", ["LlamaForCausalLM"], 3)
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    draft = vllm_speculators_to_draft_config(raw)
    assert {k: draft[k] for k in FLAGS} == {k: getattr(drafter.config, k) for k in FLAGS}
    assert set(load_file(str(tmp_path / "s" / "model.safetensors"))) == {
        k.replace("midlayer.", "layers.0.") for k in keys
    }
    loaded, _ = ck.load_drafter(tmp_path / "s")
    assert loaded.config == drafter.config
    for got, expected in zip(outputs_of(loaded), want, strict=False):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_sglang_older_fc_norm_names_load(tmp_path):
    """SGLang still reads ``use_aux_norm`` and the weights ``aux_norm_{low,mid,high}`` (its legacy_name_map)."""
    drafter = perturbed_norms(make_drafter(fc_norm=True))
    ck.save_legacy(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    del raw["fc_norm"]
    raw["use_aux_norm"] = True
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    names = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}
    state = {
        next((new + k.removeprefix(old) for old, new in names.items() if k.startswith(old)), k): v
        for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items()
    }
    assert "aux_norm_mid.weight" in state
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    loaded, _ = ck.load_drafter(tmp_path / "d")
    assert loaded.config.fc_norm
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)


def test_full_draft_vocab_is_written_without_d2t(tmp_path):
    # vLLM builds no draft_id_to_target_id when the vocabularies are equal and refuses a d2t weight then.
    drafter = make_drafter(draft_vocab_size=50)
    ck.save_legacy(drafter, tmp_path / "d")
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "d2t" not in keys and "t2d" not in keys and "lm_head.weight" in keys
    loaded, _ = ck.load_drafter(tmp_path / "d")
    assert torch.equal(loaded.draft_to_target(torch.arange(50)), torch.arange(50))
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ the MLA drafter

YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def vllm_deepseek_eagle3_load(state: dict, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """vLLM 0.32 ``deepseek_eagle3.py`` restated: which parameter each on-disk weight lands in, and the shapes of
    those parameters (``Eagle3DeepseekV2ForCausalLM.load_weights``, ``hf_to_vllm_mapper``, ``__init__``s).
    Returns the parameters' shapes as the checkpoint fills them; a key without a parameter raises, as vLLM does."""
    h, i, ht, n = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size, cfg.num_attention_heads
    a = "model.layers.0.self_attn."
    params = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.fc.weight": (h, 3 * ht),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        **{f"model.fc_norm.{j}.weight": (ht,) for j in range(3) if cfg.fc_norm},
        **{f"model.layers.0.{k}.weight": (h,) for k in ("input_layernorm", "post_attention_layernorm", "hidden_norm")},
        "model.layers.0.mlp.gate_up_proj.weight": (2 * i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
        a + "fused_qkv_a_proj.weight": (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, 2 * h),
        a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
        a + "q_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (h, n * cfg.v_head_dim),
    }
    if cfg.draft_vocab_size != cfg.vocab_size:
        params["draft_id_to_target_id"] = (cfg.draft_vocab_size,)
    stacked = {
        ".gate_proj": ".gate_up_proj",
        ".up_proj": ".gate_up_proj",
        ".q_a_proj": ".fused_qkv_a_proj",
        ".kv_a_proj_with_mqa": ".fused_qkv_a_proj",
    }
    filled: dict[str, tuple[int, ...]] = {}
    for key, tensor in state.items():
        if "t2d" in key:
            continue
        name = (
            key.replace("d2t", "draft_id_to_target_id")
            if "d2t" in key
            else (key if "lm_head" in key else "model." + key)
        )
        name = name.replace("midlayer.", "layers.0.", 1)
        shard = next((new for old, new in stacked.items() if old in name), None)
        if shard:
            name = name.replace(next(old for old in stacked if old in name), shard, 1)
        if name not in params:
            raise ValueError(f"There is no module or parameter named '{name}'")
        rows = filled.get(name, (0,))[0] + tensor.shape[0] if shard else tensor.shape[0]
        filled[name] = (rows, *tensor.shape[1:])
    return {name: (filled.get(name), shape) for name, shape in params.items()}


def sglang_kimi_k25_eagle3_load(state: dict, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """SGLang ``kimi_k25_eagle3.py`` restated (``Eagle3DeepseekV2ForCausalLM.load_weights``): parameter -> shape as
    loaded; q_a_proj and kv_a_proj_with_mqa are concatenated into fused_qkv_a_proj_with_mqa, unknown keys skipped."""
    filled, skipped, cached = {}, [], {}
    for key, tensor in state.items():
        if key in ("d2t", "t2d"):
            continue
        name = re.sub(r"^layers\.0\.", "midlayer.", key)
        name = name if name.startswith("lm_head.") else "model." + name
        for part in (".gate_proj", ".up_proj"):
            if part in name:
                target = name.replace(part, ".gate_up_proj")
                filled[target] = (filled.get(target, (0,))[0] + tensor.shape[0], *tensor.shape[1:])
                break
        else:
            if "q_a_proj" in name or "kv_a_proj_with_mqa" in name:
                cached["q" if "q_a_proj" in name else "kv"] = (name, tensor)
                if len(cached) == 2:
                    fused = cached["q"][0].replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                    filled[fused] = tuple(torch.cat([cached["q"][1], cached["kv"][1]]).shape)
            elif name.startswith(("model.midlayer.", "model.fc", "model.norm", "model.embed_tokens", "lm_head")):
                filled[name] = tuple(tensor.shape)
            else:
                skipped.append(key)
    assert not skipped, f"SGLang would skip {skipped}"
    return filled


@pytest.mark.parametrize("flags", [{}, dict(fc_norm=True, norm_output=True)])
def test_mla_plain_form_is_what_vllm_and_sglang_load(tmp_path, flags):
    from transformers import DeepseekV2Config

    drafter = perturbed_norms(make_drafter(architecture="mla", rope_scaling=YARN, **flags))
    cfg = drafter.config
    ck.save_legacy(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and raw["num_hidden_layers"] == 1
    # deepseek_v2: vLLM's SpeculativeConfig.hf_config_override turns a deepseek_v3 draft into DeepSeekMTPModel
    assert raw["model_type"] == "deepseek_v2" and raw["tie_word_embeddings"] is False
    hf = DeepseekV2Config.from_pretrained(tmp_path / "d")  # both engines build the draft config with transformers
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (
        24,
        16,
        8,
        4,
        6,
    )
    assert (hf.hidden_size, hf.num_attention_heads, hf.intermediate_size, hf.hidden_act) == (32, 4, 64, "silu")
    assert hf.draft_vocab_size == 20 and hf.target_hidden_size == 48 and hf.max_position_embeddings == 256
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 8.0
    assert hf.rope_parameters["rope_theta"] == 500000.0
    assert (hf.fc_norm, hf.norm_output, hf.norm_before_residual) == (cfg.fc_norm, cfg.norm_output, False)
    assert [i + 1 for i in hf.eagle_config["eagle_aux_hidden_state_layer_ids"]] == [2, 4, 5]

    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert not any(k.startswith("midlayer.") or "fused" in k for k in state)
    assert {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= set(state)
    for name, (got, want) in vllm_deepseek_eagle3_load(state, cfg).items():
        assert got == want or (name == "model.embed_tokens.weight" and got is None), (name, got, want)
    sglang = sglang_kimi_k25_eagle3_load(state, cfg)
    assert sglang["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"] == (24 + 16 + 4, 64)
    assert sglang["model.midlayer.mlp.gate_up_proj.weight"] == (128, 32)
    assert ("model.fc_norm.2.weight" in sglang) == cfg.fc_norm

    loaded, info = ck.load_drafter(tmp_path / "d")
    assert info.form == "legacy" and loaded.config == cfg
    for got, expected in zip(outputs_of(loaded), outputs_of(drafter), strict=False):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(EaglekitError, match="no speculators form.*algos.py"):
        ck.save_speculators(drafter, tmp_path / "s", "org/t", [], 3)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("layout", ["specforge", "vllm-fused", "sglang-fused"])
def test_published_mla_layouts_load(tmp_path, layout):
    """Other layouts of the same drafter: SpecForge's (midlayer. keys, DeepseekV3 config, no embedding, bf16),
    and the down-projection fused as each engine names it internally."""
    drafter = perturbed_norms(make_drafter(architecture="mla", fc_norm=True)).to(torch.bfloat16)
    ck.save_legacy(drafter, tmp_path / "d", include_embeddings=False)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    a = "layers.0.self_attn."
    if layout == "specforge":
        raw.update(architectures=["DeepseekV3ForCausalLMEagle3"], model_type="deepseek_v3")
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
    else:
        fused = "fused_qkv_a_proj" if layout == "vllm-fused" else "fused_qkv_a_proj_with_mqa"
        state[a + fused + ".weight"] = torch.cat(
            [state.pop(a + "q_a_proj.weight"), state.pop(a + "kv_a_proj_with_mqa.weight")]
        )
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    loaded, info = ck.load_drafter(tmp_path / "d")
    assert info.missing_embeddings and loaded.fc.weight.dtype == torch.bfloat16 and loaded.config == drafter.config
    with torch.no_grad():
        loaded.embed_tokens.weight.copy_(drafter.embed_tokens.weight)
    torch.testing.assert_close(logits_of(loaded), logits_of(drafter), rtol=0, atol=0)


def test_what_the_engines_would_serve_wrong_is_named():
    assert ck.sglang_ignores(make_drafter(fc_norm=True, norm_output=True).config) == []
    assert ck.sglang_ignores(make_drafter(norm_before_residual=True, norm_before_fc=True).config) == [
        "norm_before_residual"
    ]  # SGLang's Llama drafter reads norm_before_fc (tests/drafters/test_sglang_forms.py)
    mla = make_drafter(architecture="mla").config
    assert ck.serving_problems(mla) == []
    problems = ck.serving_problems(dataclasses.replace(mla, q_lora_rank=None))
    assert len(problems) == 1 and "fused_qkv_a_proj" in problems[0] and "kimi_k25_eagle3" in problems[0]


# ------------------------------------------------------------------------------------------ SGLang's aux ids

# SGLang's set_eagle3_layers_to_capture (the target model's side), as read in its source: before sglang#25454 every
# target, and llama.py still, adds 1 to each eagle_config id; since #25454 DeepSeek-family targets add 1 only when
# the first id is 1 and take other lists verbatim. layers_to_capture[i] = HF hidden_states[i] (captured before layer i).
SGLANG_RULES = (lambda ids: [i + 1 for i in ids], lambda ids: [i + 1 for i in ids] if ids[0] == 1 else list(ids))


@pytest.mark.parametrize("aux,portable", [([2, 4, 5], True), ([2, 3, 6], True), ([3, 5, 6], False), ([1, 4, 6], False)])
def test_sglang_aux_ids_are_written_only_where_every_sglang_reads_them_alike(tmp_path, aux, portable):
    ids = ck.sglang_aux_layer_ids(aux)
    if portable:
        assert all(rule(ids) == aux for rule in SGLANG_RULES)
    else:
        assert ids is None
        # no list means `aux` under both rules: the ids one less are wrong since #25454, the ids as-is before it
        assert SGLANG_RULES[1]([i - 1 for i in aux]) != aux and SGLANG_RULES[0](list(aux)) != aux
    ck.save_legacy(make_drafter(aux=aux), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == aux  # vLLM's key, always
    assert ("eagle_config" in raw) == portable
    assert ck.load_drafter(tmp_path / "d")[1].aux_layer_ids == aux


def test_served_settings_read_the_config_as_each_engine_does(tmp_path):
    ck.save_legacy(make_drafter(aux=[2, 4, 5]), tmp_path / "legacy")
    ck.save_speculators(make_drafter(aux=[2, 4, 5]), tmp_path / "spec", "org/t", ["LlamaForCausalLM"], 3)
    legacy = ck.served_settings(tmp_path / "legacy", "vllm", 8)
    assert (legacy.aux_layer_ids, legacy.norm_before_residual, legacy.max_position_embeddings) == (
        [[2, 4, 5]],
        False,
        256,
    )
    assert ck.served_settings(tmp_path / "legacy", "sglang", 8).aux_layer_ids == [[2, 4, 5]]
    assert ck.served_settings(tmp_path / "spec", "vllm", 8).norm_before_residual is False

    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    del raw["norm_before_residual"], raw["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(raw))
    bare = ck.served_settings(tmp_path / "spec", "vllm", 8)
    assert bare.norm_before_residual is True  # vLLM's speculators default when the key is absent
    assert bare.aux_layer_ids == [[2, 4, 5]]  # the default [2, N//2, N-3] for N=8

    raw = json.loads((tmp_path / "legacy" / "config.json").read_text())
    del raw["eagle_aux_hidden_state_layer_ids"]
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # a "capture-before" list, no vLLM key
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(raw))
    assert ck.served_settings(tmp_path / "legacy", "vllm", 8).aux_layer_ids == [[2, 4, 5]]  # vLLM: verbatim
    assert ck.served_settings(tmp_path / "legacy", "sglang", 8).aux_layer_ids == [[3, 5, 6], [2, 4, 5]]


def test_served_settings_read_the_flags_as_each_engine_does(tmp_path):
    """vLLM reads fc_norm, norm_output and norm_before_residual from the top level (llama_eagle3.py, deepseek_eagle3.py)
    and norm_before_fc in its Llama drafter only, eagle_config's first; SGLang reads fc_norm (or use_aux_norm) and
    norm_output, nothing else."""
    ck.save_legacy(make_drafter(fc_norm=True, norm_output=True, norm_before_residual=True), tmp_path / "l")
    assert ck.served_settings(tmp_path / "l", "vllm", 8).flags == {
        "fc_norm": True,
        "norm_output": True,
        "norm_before_fc": False,
        "norm_before_residual": True,
    }
    assert ck.served_settings(tmp_path / "l", "sglang", 8).flags == {
        "fc_norm": True,
        "norm_output": True,
        "norm_before_fc": False,
        "norm_before_residual": False,
    }

    ck.save_legacy(make_drafter(norm_before_fc=True), tmp_path / "n")
    assert ck.served_settings(tmp_path / "n", "vllm", 8).flags["norm_before_fc"] is True
    assert ck.served_settings(tmp_path / "n", "sglang", 8).flags["norm_before_fc"] is False
    raw = json.loads((tmp_path / "n" / "config.json").read_text())
    raw["eagle_config"]["norm_before_fc"] = False  # vLLM's Llama drafter asks eagle_config first
    raw["use_aux_norm"] = True  # SGLang's older name of fc_norm; vLLM does not know it
    (tmp_path / "n" / "config.json").write_text(json.dumps(raw))
    vllm, sglang = (ck.served_settings(tmp_path / "n", e, 8).flags for e in ("vllm", "sglang"))
    assert (vllm["norm_before_fc"], vllm["fc_norm"], sglang["fc_norm"]) == (False, False, True)

    ck.save_legacy(make_drafter(architecture="mla", fc_norm=True), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["norm_before_fc"] = True  # deepseek_eagle3.py has no input_norm: never read for an MLA drafter
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    mla = ck.served_settings(tmp_path / "m", "vllm", 8)
    assert mla.flags["norm_before_fc"] is False and mla.flags["fc_norm"] is True
    assert mla.max_position_embeddings == 256 and mla.rope_theta == 500000.0

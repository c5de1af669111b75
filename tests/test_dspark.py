"""The DSpark block drafter: its objective (anchor sampling, the Markov bias), training on the tiny target, block
decoding as vLLM's DSpark speculator does it (lossless at T=0), and the export checked by vLLM 0.32's own loader."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from block_drafters import heldout_prompts, one_round_two_ways, train_block_drafter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.drafters.registry import proposer_for
from eaglekit.errors import EaglekitError
from eaglekit.model.dflash import DFlashConfig, DFlashDrafter, default_mask_token_id
from eaglekit.model.dspark import DSparkConfig, DSparkDrafter
from eaglekit.model.dspark_checkpoint import expected_state, load_dspark, read_dspark_config, save_dspark
from eaglekit.model.target import default_aux_layers
from eaglekit.speculative.block import DSparkProposer
from eaglekit.speculative.decode import generate
from eaglekit.training.block import block_loss, position_weights

BLOCK = 4  # DSpark drafts all 4 slots of a block (anchor sampling)


def small(cls, hf, **extra):
    aux = default_aux_layers(hf.num_hidden_layers)
    return cls.from_target_config(hf, aux, 0, num_hidden_layers=1, block_size=BLOCK, **extra)


def test_dspark_trains_every_slot_from_the_anchor_and_conditions_on_its_own_token(tiny_target):
    """DFlash's anchor slot does not draft; DSpark's does (it predicts the token after the anchor), and each slot's
    Markov bias reads the token at the slot's own position: only those rows of markov_w1 get a gradient."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target).config
    torch.manual_seed(0)
    spark, flash = DSparkDrafter(small(DSparkConfig, hf, markov_rank=8)), DFlashDrafter(small(DFlashConfig, hf))
    length = 24
    ids = torch.randint(1, hf.vocab_size, (2, length))
    argmax = torch.randint(1, hf.vocab_size, (2, length))
    aux = torch.randn(2, length, len(spark.config.aux_layer_ids) * hf.hidden_size)
    loss_mask = torch.zeros(2, length, dtype=torch.long)
    loss_mask[:, 8:] = 1
    ones = torch.ones(2, length, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    out = block_loss(spark, aux, argmax, ids, loss_mask, ones, generator=gen, max_anchors=3)
    base = block_loss(
        flash, aux, argmax, ids, loss_mask, ones, generator=torch.Generator().manual_seed(0), max_anchors=3
    )
    assert out.counted[0] > 0 and base.counted[0] == 0  # DSpark's anchor slot is trained, DFlash's is not
    assert out.counted.sum() > base.counted.sum()
    out.loss.backward()
    touched = set(spark.markov_head.markov_w1.weight.grad.abs().sum(-1).nonzero().flatten().tolist())
    # anchors are drawn among positions 8.. (the loss mask); a slot's token is at anchor + slot
    assert touched and touched <= set(ids[:, 8:].flatten().tolist())
    assert spark.markov_head.markov_w2.weight.grad.abs().sum() > 0


def test_dspark_exp_decay_starts_at_its_anchor_slot():
    ce, counted = torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool)
    got = position_weights(ce, counted, "exp-decay", 0.5, gamma=2.0, first_slot=0)
    assert got[0].tolist() == pytest.approx([torch.exp(torch.tensor(-k / 2.0)).item() for k in range(4)])


# ------------------------------------------------------------------------------------ trained on the tiny target


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target).eval(), AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def trained(target):
    """A 2-layer, block-4, Markov rank 32 drafter trained 120 steps (seed 0) on the tiny corpus, online features."""
    model, tok = target
    torch.manual_seed(0)
    aux = default_aux_layers(model.config.num_hidden_layers)
    mask_id = default_mask_token_id(tok, model.config.vocab_size)
    cfg = DSparkConfig.from_target_config(
        model.config, aux, mask_id, num_hidden_layers=2, block_size=BLOCK, markov_rank=32
    )
    return train_block_drafter(model, tok, DSparkDrafter(cfg))


def test_training_lowers_the_loss_and_raises_the_block_acceptance(trained):
    _, taus, losses = trained
    first, last = sum(taus[:10]) / 10, sum(taus[-10:]) / 10
    assert last > first + 1.0, (first, last)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


@pytest.mark.parametrize("k", [1, BLOCK, BLOCK + 1])
def test_dspark_decoding_is_lossless_at_t0_and_accepts_drafts(target, trained, k):
    model, tok = target
    drafter, _, _ = trained
    assert isinstance(proposer_for(drafter), DSparkProposer)
    total = None
    for prompt in heldout_prompts(tok, 4):
        plain = generate(model, prompt, 48)
        spec = generate(model, prompt, 48, proposer=proposer_for(drafter), k=k)
        assert spec.tokens == plain.tokens
        total = spec.stats if total is None else total + spec.stats
    assert total is not None and len(total.acceptance_by_position()) == k
    assert total.tau > 1 + 0.5 * min(k, BLOCK), total.tau


def test_proposer_drafts_from_k_queries_left_to_right_with_the_markov_bias(target, trained):
    """vLLM's DSpark round (anchor sampling): K queries [last token, mask × (K-1)] at positions n..n+K-1, the base
    logits of all K, then draft i = argmax(base_i + markov_w2 · markov_w1[draft i-1]), draft -1 being the last
    token; recomputed here from one uncached forward over the whole context."""
    model, tok = target
    drafter, _, _ = trained
    prompt = heldout_prompts(tok, 1)[0]
    cached, base, last = one_round_two_ways(model, drafter, proposer_for(drafter), prompt, drafts=3, masks=2)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    prev, want = last, []
    for i in range(3):
        prev = int((base[i] + w2 @ w1[prev]).argmax())
        want.append(prev)
    assert cached == want


# ------------------------------------------------------------------------------------------------------- export


def test_export_reads_back_and_refuses_a_lost_key_by_name(tmp_path, target, trained):
    model, tok = target
    drafter, _, _ = trained
    save_dspark(drafter, tmp_path / "dspark")
    state = load_file(str(tmp_path / "dspark" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_state(drafter.config)
    (tmp_path / "dspark" / "eaglekit.json").unlink()  # re-import from vLLM's config.json alone
    assert read_dspark_config(tmp_path / "dspark").markov_rank == drafter.config.markov_rank
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    again = load_dspark(tmp_path / "dspark", embed, head).eval()
    assert again.config == drafter.config
    for prompt in heldout_prompts(tok, 2):
        a = generate(model, prompt, 32, proposer=proposer_for(drafter), k=3)
        b = generate(model, prompt, 32, proposer=proposer_for(again), k=3)
        assert a.accepted_per_round == b.accepted_per_round

    del state["markov_head.markov_w2.weight"]
    save_file(state, str(tmp_path / "dspark" / "model.safetensors"))
    with pytest.raises(EaglekitError, match=r"missing key markov_head\.markov_w2\.weight"):
        load_dspark(tmp_path / "dspark", embed, head)


# vLLM's own loader, on the CPU: the config vLLM builds from the export (method, draft token id, aux layers), the
# Qwen3DSparkForCausalLM it constructs from it, and every weight it loads. The CPU build refuses DSpark in its V1
# runner at config time (the refusal is checked first, with vLLM's own message), so the probe then lifts that one
# validation to build the config the V2 runner would get; nothing else of the engine is started.
LOADER_PROBE = """
import json, sys
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs

target, draft = sys.argv[1], sys.argv[2]
spec = {"method": "dspark", "model": draft, "num_speculative_tokens": 4}
args = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256, speculative_config=spec)
try:
    args.create_engine_config()
    refusal = None
except Exception as err:
    refusal = str(err)
VllmConfig._validate_v1_model_runner = lambda self: None
cfg = args.create_engine_config()
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

with set_current_vllm_config(cfg):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:" + sys.argv[3], backend="gloo"
    )
    initialize_model_parallel(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=cfg)
    state = load_file(draft + "/model.safetensors")
    model.load_weights(state.items())
hf = cfg.speculative_config.draft_model_config.hf_config
print(json.dumps({
    "refusal": refusal,
    "method": cfg.speculative_config.method,
    "architectures": hf.architectures,
    "mask_token_id": get_parallel_drafting_token_id(hf),
    "aux_layers": list(get_eagle3_aux_layers_from_config(cfg.speculative_config)),
    "confidence_head": model.model.confidence_head is not None,
    "params": {k: v.detach().tolist() for k, v in model.named_parameters()},
}))
"""


def test_vllm_loads_every_exported_weight_into_its_dspark_model(tmp_path, tiny_target, vllm_python):
    from eaglekit.serving.engine import cpu_environment, free_port

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target).config
    cfg = DSparkConfig.from_target_config(
        hf, default_aux_layers(hf.num_hidden_layers), 7, num_hidden_layers=2, block_size=BLOCK, markov_rank=8
    )
    drafter = DSparkDrafter(cfg)
    for p in drafter.parameters():  # distinct values everywhere, so a weight loaded into the wrong slot shows
        torch.nn.init.normal_(p)
    save_dspark(drafter, tmp_path / "dspark")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **cpu_environment(vllm_python)}
    probe = subprocess.run(
        [str(vllm_python), "-c", LOADER_PROBE, str(tiny_target), str(tmp_path / "dspark"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "Model Runner V1 does not support: dspark speculative decoding" in got["refusal"]
    assert got["method"] == "dspark" and got["architectures"] == ["Qwen3DSparkModel"]
    assert got["mask_token_id"] == 7 and got["aux_layers"] == cfg.aux_layer_ids
    assert got["confidence_head"] is False  # none exported: vLLM drops the head

    params = {k: torch.tensor(v) for k, v in got["params"].items()}
    ours = {k: v.detach() for k, v in drafter.state_dict().items()}
    want = {"model.fc.weight": ours["fc.weight"], "model.hidden_norm.weight": ours["hidden_norm.weight"]}
    want["model.norm.weight"] = ours["norm.weight"]
    want["model.markov_head.markov_w1.weight"] = ours["markov_head.markov_w1.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        want[f"model.{p}self_attn.qkv_proj.weight"] = torch.cat([ours[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        want[f"model.{p}mlp.gate_up_proj.weight"] = torch.cat(
            [ours[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
        )
        for name in ("self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj"):
            want[f"model.{p}{name}.weight"] = ours[f"{p}{name}.weight"]
        for name in ("input_layernorm", "post_attention_layernorm"):
            want[f"model.{p}{name}.weight"] = ours[f"{p}{name}.weight"]
    for name, value in want.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
    # markov_w2 is a vocabulary head: vLLM pads its rows to a multiple of 64, ours come first
    w2 = ours["markov_head.markov_w2.weight"]
    torch.testing.assert_close(params["model.markov_head.markov_w2.weight"][: w2.shape[0]], w2, rtol=0, atol=0)
    # the rest are the target's at serving time (embedding, head) or the placeholder the loader skips
    loaded = set(want) | {"model.markov_head.markov_w2.weight"}
    assert set(params) - loaded == {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}


def test_exported_config_has_the_keys_vllm_reads(tmp_path, trained):
    drafter, _, _ = trained
    save_dspark(drafter, tmp_path / "dspark")
    config = json.loads(Path(tmp_path / "dspark" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert [i + 1 for i in config["target_layer_ids"]] == drafter.config.aux_layer_ids
    assert config["mask_token_id"] == drafter.config.mask_token_id
    assert config["markov_rank"] == 32 and config["markov_head_type"] == "vanilla"
    assert config["sample_from_anchor"] is True and config["dspark_bonus_anchor"] is False
    assert config["enable_confidence_head"] is False and config["block_size"] == BLOCK


# ---------------------------------------------------------------------------------------------- pre-flight, plan


def block_run_config(tmp_path: Path, target: Path, **draft):
    from eaglekit.config import parse_config

    data = {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "p.jsonl"}}
    return parse_config(data | {"train": {"draft": draft}}, base_dir=tmp_path)


def test_preflight_and_plan_size_the_dspark_drafter(tmp_path, tiny_target):
    from eaglekit.drafters.dspark import DSPARK
    from eaglekit.drafters.registry import fresh_drafter_config, parameter_counts

    dspark = block_run_config(tmp_path, tiny_target, architecture="dspark", num_layers=2, markov_rank=16)
    dflash = block_run_config(tmp_path, tiny_target, architecture="dflash", num_layers=2)
    spark_cfg = fresh_drafter_config(dspark)
    assert isinstance(spark_cfg, DSparkConfig) and spark_cfg.markov_rank == 16
    (_, spark), (_, flash) = parameter_counts(dspark), parameter_counts(dflash)
    assert spark - flash == 2 * spark_cfg.vocab_size * 16  # the Markov head: markov_w1 and markov_w2 train
    check = DSPARK.shape_check(dspark)
    assert check.level == "ok" and check.detail.startswith("dspark: 2 layers") and "Markov rank 16" in check.detail


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_preflight_refuses_a_block_drafter_on_an_mla_target(tmp_path, tiny_target, family):
    """Non-causal block drafts on a target with multi-head latent attention: refused by name (z-lab/dflash#62)."""
    from transformers import DeepseekV3Config

    from eaglekit.drafters.registry import family_named

    mla = tmp_path / "mla-target"
    DeepseekV3Config(
        vocab_size=514, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=1024,
    ).save_pretrained(mla)  # fmt: skip
    check = family_named(family).shape_check(block_run_config(tmp_path, mla, architecture=family, mask_token_id=0))
    assert check.level == "fail", check
    assert "multi-head latent attention" in check.detail and "z-lab/dflash#62" in check.detail
    assert "architecture: mla" in check.remedy


def test_verify_preflight_names_the_cpu_builds_refusal(tmp_path, tiny_target, vllm_python):
    """vLLM's own words, from its source: the check quotes what the CPU build's V1 runner says (and why)."""
    from eaglekit.contract import StageContext
    from eaglekit.drafters.dspark import NOT_ON_CPU as DSPARK_ON_CPU
    from eaglekit.rundir import RunDir
    from eaglekit.stages.verify import engine_serves_forms

    source = (vllm_python.parent.parent / "lib").glob("python*/site-packages/vllm/config/vllm.py")
    text = next(source).read_text()
    assert 'unsupported.append("dspark speculative decoding")' in text
    assert 'f"Model Runner V1 does not support: {' in text and '"Model Runner V2 requires Triton."' in text
    assert "Model Runner V1 does not support: dspark speculative decoding" in DSPARK_ON_CPU

    cfg = block_run_config(tmp_path, tiny_target, architecture="dspark")
    cfg.verify.engine, cfg.verify.python = "vllm", str(vllm_python)
    check = engine_serves_forms(StageContext(cfg=cfg, run=RunDir(cfg.run_dir), stage="verify", fingerprint=""))
    assert check.status == "fail" and DSPARK_ON_CPU in check.detail and "GPU" in check.remedy
    cfg.train.draft.architecture = "dflash"
    assert (
        engine_serves_forms(StageContext(cfg=cfg, run=RunDir(cfg.run_dir), stage="verify", fingerprint="")).status
        == "ok"
    )

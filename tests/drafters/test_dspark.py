"""The DSpark block drafter's own parts: its objective (anchor sampling, the Markov bias), its export checked by vLLM
0.32's own loader, its size in plan and pre-flight, and verify's refusal on vLLM's CPU build. What every block family
does (training, decoding, the export read back key by key, `eaglekit run`) is tested in tests/drafters/test_families.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.helpers import run_in_vllm
from test_families import block_run_config
from transformers import AutoModelForCausalLM

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.objective import block_loss, position_weights
from eaglekit.drafters.dspark.checkpoint import save_dspark
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.model.target import default_aux_layers

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
    from eaglekit.serving.engine import free_port

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target).config
    cfg = DSparkConfig.from_target_config(
        hf, default_aux_layers(hf.num_hidden_layers), 7, num_hidden_layers=2, block_size=BLOCK, markov_rank=8
    )
    drafter = DSparkDrafter(cfg)
    for p in drafter.parameters():  # distinct values everywhere, so a weight loaded into the wrong slot shows
        torch.nn.init.normal_(p)
    save_dspark(drafter, tmp_path / "dspark")
    probe = run_in_vllm(vllm_python, LOADER_PROBE, tiny_target, tmp_path / "dspark", free_port(), cwd=tmp_path)
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


# ---------------------------------------------------------------------------------------------- pre-flight, plan


def test_preflight_and_plan_size_the_dspark_drafter(tmp_path, tiny_target):
    from eaglekit.drafters.dspark.family import DSPARK
    from eaglekit.drafters.registry import fresh_drafter_config, parameter_counts

    dspark = block_run_config(tmp_path, tiny_target, architecture="dspark", num_layers=2, markov_rank=16)
    dflash = block_run_config(tmp_path, tiny_target, architecture="dflash", num_layers=2)
    spark_cfg = fresh_drafter_config(dspark)
    assert isinstance(spark_cfg, DSparkConfig) and spark_cfg.markov_rank == 16
    (_, spark), (_, flash) = parameter_counts(dspark), parameter_counts(dflash)
    assert spark - flash == 2 * spark_cfg.vocab_size * 16  # the Markov head: markov_w1 and markov_w2 train
    check = DSPARK.diagnosis.shape_check(dspark)
    assert check.level == "ok" and check.detail.startswith("dspark: 2 layers") and "Markov rank 16" in check.detail


def test_a_block_drafter_for_a_run_configured_for_another_family_takes_the_block_defaults(tmp_path, tiny_target):
    """config_for_run reads train.draft as its own family's section (`draft_as`): for a run whose train.draft is
    EAGLE-3's (a finetune whose train.init_from holds a block drafter) it keeps the keys the families share and takes
    the block keys' defaults, where reading them off the EAGLE-3 section raised AttributeError."""
    from eaglekit.drafters.dflash import model as dflash
    from eaglekit.drafters.dspark import model as dspark
    from eaglekit.drafters.dspark.model import DEFAULT_MARKOV_RANK
    from eaglekit.model.run_shapes import target_and_aux

    eagle = block_run_config(tmp_path, tiny_target, num_attention_heads=2)  # architecture unset: llama
    hf, aux = target_and_aux(eagle)
    flash = dflash.config_for_run(eagle, hf, aux, hf.vocab_size)
    spark = dspark.config_for_run(eagle, hf, aux, hf.vocab_size)
    fresh = dflash.config_for_run(
        block_run_config(tmp_path, tiny_target, architecture="dflash"), hf, aux, hf.vocab_size
    )
    assert flash.num_attention_heads == spark.num_attention_heads == 2  # a key both families read
    assert dataclasses.replace(flash, num_attention_heads=fresh.num_attention_heads) == fresh  # the rest: defaults
    assert spark.markov_rank == DEFAULT_MARKOV_RANK


def test_verify_preflight_names_the_cpu_builds_refusal(tmp_path, tiny_target, vllm_python):
    """vLLM's own words, from its source: the check quotes what the CPU build's V1 runner says (and why)."""
    from eaglekit.contract import StageContext
    from eaglekit.drafters.dspark.family import NOT_ON_CPU as DSPARK_ON_CPU
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
    cfg.train.draft = {"architecture": "dflash"}
    assert (
        engine_serves_forms(StageContext(cfg=cfg, run=RunDir(cfg.run_dir), stage="verify", fingerprint="")).status
        == "ok"
    )

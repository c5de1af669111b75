"""What every drafter family of the registry (drafters/registry.FAMILIES) does, one test per behaviour parametrised
over the families (ids: their names). Every family: its training checkpoint reads back as the drafter it holds. Every
block family (DFlash, DSpark): trained on the tiny target, it raises the block acceptance, decodes losslessly at T=0
through the proposer the registry gives it, and that proposer drafts what one uncached forward drafts; its export is
the form vLLM 0.32 loads, key by key, reads back from vLLM's config.json alone, and a checkpoint that lost any key
is refused by name; pre-flight refuses it on an MLA target; `eaglekit run` trains, evaluates and exports it,
re-imports the export to finetune from offline shards, and resumes after kill -9 to the uninterrupted run; verify on
vLLM's CPU build serves DFlash at its offline acceptance and refuses DSpark by name. What one family alone does stays
in its file (tests/test_dflash*.py, tests/drafters/test_dspark.py, tests/drafters/test_checkpoints.py, tests/test_mla*.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from support.block_drafters import heldout_prompts, one_round_two_ways, train_block_drafter
from test_extract import prepared_run
from test_train import kill_9_then_resume
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit import adapt
from eaglekit.config import parse_config
from eaglekit.drafters.dflash.checkpoint import read_dflash_config
from eaglekit.drafters.dflash.model import DFlashDrafter
from eaglekit.drafters.dflash.proposer import BlockProposer
from eaglekit.drafters.dflash2.checkpoint import read_dflash2_config
from eaglekit.drafters.dflash2.proposer import DFlash2Proposer
from eaglekit.drafters.dspark.checkpoint import read_dspark_config
from eaglekit.drafters.dspark.proposer import DSparkProposer
from eaglekit.drafters.registry import FAMILIES, family_named, family_of_folder, fresh_drafter_config, proposer_for
from eaglekit.errors import EaglekitError
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import embedding_and_head
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.speculative.decode import generate
from eaglekit.tiny.corpus import sample_tasks

# The block drafter families as the registry lists them: a block family added there is tested here, and fails by
# name where the tables below lack its entry.
BLOCK_FAMILIES = [name for name, family in FAMILIES.items() if issubclass(family.drafter_class, DFlashDrafter)]
BLOCK = 4
# train.draft of the drafters trained here: DFlash with one k_norm for both layers, which vLLM's CPU build serves
# exactly (tests/drafters/test_dflash.py, the kernel probe); DSpark with a Markov rank of 32
OWN_DRAFT = {
    "dflash": {"shared_k_norm": True},
    "dspark": {"markov_rank": 32},
    "dflash2": {"shared_k_norm": True, "selector_rank": 32},
}
SMALL_DRAFT = {"dflash": {}, "dspark": {"markov_rank": 8}, "dflash2": {"selector_rank": 8}}  # the kill -9 runs' keys
# the block τ of the first 10 steps, before the drafter has learned: DSpark's anchor slot drafts the token right
# after the verified one, the easiest of the block (measured, seed 0: DFlash 1.09, DSpark 1.36)
UNTRAINED_TAU_BELOW = {"dflash": 1.3, "dspark": 1.5, "dflash2": 1.3}
PROPOSER = {"dflash": BlockProposer, "dspark": DSparkProposer, "dflash2": DFlash2Proposer}
READ_CONFIG = {"dflash": read_dflash_config, "dspark": read_dspark_config, "dflash2": read_dflash2_config}
# what vLLM 0.32 reads from the exported config.json: the architecture; the section holding the aux taps
# (target_layer_ids) and the mask token; the family's own keys
VLLM_ARCHITECTURE = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel", "dflash2": "DFlash2DraftModel"}
VLLM_SECTION = {
    "dflash": lambda config: config["dflash_config"],
    "dspark": lambda config: config,
    "dflash2": lambda config: config["dflash_config"],
}
VLLM_OWN_KEYS: dict[str, dict] = {
    "dflash": {},
    "dspark": {
        "markov_rank": 32,
        "markov_head_type": "vanilla",
        "sample_from_anchor": True,
        "dspark_bonus_anchor": False,
        "enable_confidence_head": False,
        "block_size": BLOCK,
    },
    "dflash2": {},  # its own keys sit in dflash_config (tests/test_dflash2.py)
}
# vLLM's parameters beyond DFlash's backbone (tests/drafters/test_dspark.py: vLLM's own loader fills them from ours)
VLLM_OWN_PARAMETERS: dict[str, set[str]] = {
    "dflash": set(),
    "dspark": {"model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight"},
    # tests/test_dflash2.py: vLLM's own loader fills them from ours; the drafters trained here have 2 layers
    "dflash2": {
        f"model.layers.{i}.{conv}.{name}"
        for i in range(2)
        for conv in ("attention_conv", "mlp_conv")
        for name in ("base_kernel", "kernel_projection.weight")
    }
    | {f"model.candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook")}
    | {"model.candidate_selector.hidden_projection.weight"},
}


def draft_slots(family: str) -> int:
    """The slots of a block that draft: DFlash's anchor slot holds the bonus token, DSpark's drafts too."""
    return BLOCK - FAMILIES[family].drafter_class.first_drafting_slot


def markov_drafts(drafter, base: torch.Tensor, last: int) -> list[int]:
    """vLLM's DSpark round (anchor sampling): draft i = argmax(base_i + markov_w2 · markov_w1[draft i-1]), draft -1
    being the last verified token."""
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    prev, drafts = last, []
    for logits in base:
        prev = int((logits + w2 @ w1[prev]).argmax())
        drafts.append(prev)
    return drafts


# a round's drafts from the base logits (and normed hidden states) of the drafting slots, as the family's vLLM
# proposer drafts them
DRAFTS_FROM_LOGITS = {
    "dflash": lambda drafter, base, hidden, last: base.argmax(-1).tolist(),
    "dspark": lambda drafter, base, hidden, last: markov_drafts(drafter, base, last),
    "dflash2": lambda drafter, base, hidden, last: drafter.draft_path(base, hidden, last),
}


def block_run_config(tmp_path: Path, target: Path, **draft):
    data = {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "p.jsonl"}}
    return parse_config(data | {"train": {"draft": draft}}, base_dir=tmp_path)


# ------------------------------------------------------------------------------------------- every family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_training_checkpoint_reads_back_as_the_drafter_it_holds(tmp_path, tiny_target, family):
    """The drafter a fresh run builds, written as the family's training checkpoint, is recognised by the registry
    as the family's and loads back for the target with every weight and its config."""
    cfg = block_run_config(tmp_path, tiny_target, architecture=family)
    cfg.vocab.draft_vocab_size = 200
    hf, aux = target_and_aux(cfg)
    embed, head = embedding_and_head(str(tiny_target))
    torch.manual_seed(0)
    drafter = (
        FAMILIES[family]
        .training.build(cfg, hf, *build_d2t_t2d(torch.arange(200), hf.vocab_size), embed, head, aux)
        .drafter
    )
    state = drafter.state_dict()
    FAMILIES[family].training.save_checkpoint(drafter.config, state, tmp_path / "checkpoint")
    assert family_of_folder(tmp_path / "checkpoint") is FAMILIES[family]
    again, info = FAMILIES[family].reading.load_checkpoint(cfg, tmp_path / "checkpoint", aux)
    assert again.config == drafter.config and info.aux_layer_ids == aux
    read = again.state_dict()
    assert read.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(read[key].to(value), value), key


def evaluated_untrained_drafter(tmp_path: Path, target: Path, family: str, **export):
    """The config of a run whose evaluate stage has measured the family's untrained drafter (3 prompts, K=2):
    everything export and publish read, in seconds."""
    prompts = tmp_path / "prompts.jsonl"
    tasks = sample_tasks(3, seed=99, split="heldout")
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t.prompt}]}) + "\n"
            for i, t in enumerate(tasks)
        )
    )
    cfg = block_run_config(tmp_path, target, architecture=family)
    for key, value in export.items():
        setattr(cfg.export, key, value)
    cfg.vocab.draft_vocab_size = 200
    hf, aux = target_and_aux(cfg)
    embed, head = embedding_and_head(str(target))
    torch.manual_seed(0)
    d2t, t2d = build_d2t_t2d(torch.arange(200), hf.vocab_size)
    drafter = FAMILIES[family].training.build(cfg, hf, d2t, t2d, embed, head, aux).drafter
    FAMILIES[family].training.save_checkpoint(drafter.config, drafter.state_dict(), tmp_path / "untrained")
    cfg.evaluate.prompts, cfg.evaluate.checkpoint = str(prompts), str(tmp_path / "untrained")
    cfg.evaluate.num_samples, cfg.evaluate.num_speculative_tokens, cfg.evaluate.temperatures = 5, [2], [0.0]
    cfg.evaluate.max_new_tokens = cfg.export.num_speculative_tokens = 2
    with RunDir(cfg.run_dir).lock:
        evaluated = run_stage(cfg, "evaluate", skip_preflight=True)
    assert len(evaluated["warnings"]) == 2, evaluated["warnings"]
    return cfg


def served_as_verify_reports_it(cfg, family: str) -> None:
    verify = cfg.run_path / "verify"
    verify.mkdir()
    served = {"verdict": "pass", "runs": [{"form": FAMILIES[family].engine.forms[0], "k": 2, "passed": True,
              "tau": {"served": 1.25, "offline": 1.25}, "largest_position_difference": 0.0,
              "greedy": {"identical": 3, "prompts": 3}}]}  # fmt: skip
    (verify / "report.json").write_text(json.dumps(served))  # what verify wrote, as far as the card reads it


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_export_has_the_model_card(tmp_path, tiny_target, family):
    """export/README.md is the export stage's, whatever the family: the drafter, the run's inherited warnings (an
    untrained drafter evaluated on fewer prompts than asked: evaluate warned twice), evaluate's τ table by K and
    temperature, verify's served figures once verify has run, the serve commands and what each form's folder holds."""
    cfg = evaluated_untrained_drafter(tmp_path, tiny_target, family)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "export", skip_preflight=True)
        card = (cfg.run_path / "export" / "README.md").read_text()
        served_as_verify_reports_it(cfg, family)
        shutil.rmtree(cfg.run_path / "export")  # a done export is skipped: written again, now after verify
        run_stage(cfg, "export", skip_preflight=True)
        again = (cfg.run_path / "export" / "README.md").read_text()
    form = FAMILIES[family].engine.forms[0]
    assert card.startswith("# ") and "drafter\n" in card.splitlines()[0] + "\n"
    assert "## Warnings: read before serving" in card and "evaluate: decoded 3 prompts" in card
    assert "| method | K | τ T=0 | speedup T=0 |" in card and "| eagle | 2 |" in card
    assert f"- `{form}/`: " in card and "## Serve" in card
    assert "## Served" not in card  # verify had not run
    assert "## Served (eaglekit verify)" in again and f"| {form} | 2 | 1.250 | 1.250 |" in again


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_publish_dry_run_writes_a_card_the_hub_parses(tmp_path, tiny_target, family, cli):
    """`eaglekit publish --dry-run` of each family's export: the folder holds every file of the form as export wrote
    it and a model card that huggingface_hub's own ModelCard parses, with the verifier as base_model, the family's
    tag, evaluate's τ and no path of this machine."""
    from huggingface_hub import ModelCard

    cfg = evaluated_untrained_drafter(tmp_path, tiny_target, family, verifier="eaglekit-tests/tiny-target")
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "export", skip_preflight=True)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    result = cli("publish", config, "--repo", f"me/tiny-{family}", "--dry-run", "--json", "--license", "mit")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    form, folder = doc["form"], Path(doc["folder"])
    assert form in FAMILIES[family].engine.forms
    for path in (cfg.run_path / "export" / form).iterdir():
        if path.is_file() and not path.name.startswith("."):
            assert (folder / path.name).read_bytes() == path.read_bytes(), path.name
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "eaglekit-tests/tiny-target" and card.data.license == "mit"
    assert {"speculative-decoding", {"llama": "eagle3", "mla": "eagle3"}.get(family, family)} <= set(card.data.tags)
    assert "| eagle | 2 |" in card.text and "## Warnings: read before serving" in card.text
    assert str(tmp_path) not in card.text and f"me/tiny-{family}" in card.text
    assert "Not verified in a serving engine" in card.text  # verify never ran on this export


# ------------------------------------------------------------------------------------ trained on the tiny target


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target).eval(), AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module", params=BLOCK_FAMILIES)
def trained(request, target, tiny_target, tmp_path_factory):
    """(family, its drafter as a fresh run builds it (2 layers, block 4, the default aux layers and mask token)
    trained 120 steps (seed 0) on the tiny corpus with online target features, block τ and loss per step)."""
    model, tok = target
    family = FAMILIES[request.param]
    draft = {"architecture": request.param, "num_layers": 2, "block_size": BLOCK, **OWN_DRAFT[request.param]}
    dc = fresh_drafter_config(block_run_config(tmp_path_factory.mktemp("config"), tiny_target, **draft))
    torch.manual_seed(0)
    drafter, taus, losses = train_block_drafter(model, tok, family.drafter_class(dc))
    return request.param, drafter, taus, losses


def test_training_lowers_the_loss_and_raises_the_block_acceptance(trained):
    family, _, taus, losses = trained
    first, last = sum(taus[:10]) / 10, sum(taus[-10:]) / 10
    print(f"block tau {first:.3f} -> {last:.3f}, loss {sum(losses[:10]):.2f} -> {sum(losses[-10:]):.2f}")
    assert first < UNTRAINED_TAU_BELOW[family] and last > first + 1.0, (first, last)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


@pytest.mark.parametrize("k", ["1", "slots", "block+1"])
def test_block_decoding_is_lossless_at_t0_and_accepts_drafts(target, trained, k):
    model, tok = target
    family, drafter, _, _ = trained
    slots = draft_slots(family)
    n = {"1": 1, "slots": slots, "block+1": BLOCK + 1}[k]
    assert type(proposer_for(drafter)) is PROPOSER[family]
    total = None
    for prompt in heldout_prompts(tok, 4):
        plain = generate(model, prompt, 48)
        spec = generate(model, prompt, 48, proposer=proposer_for(drafter), k=n)
        assert spec.tokens == plain.tokens
        total = spec.stats if total is None else total + spec.stats
    assert total is not None and len(total.acceptance_by_position()) == n
    assert total.tau > 1 + 0.5 * min(n, slots), total.tau  # drafts are accepted, not just tolerated


def test_proposer_drafts_what_one_uncached_forward_drafts(target, trained):
    """The proposer's cached context equals recomputing all of it: a round's drafts depend only on the verified
    tokens' states, as in vLLM, whose cache holds each context position's keys/values once. The query is vLLM's:
    [last token, mask × (K - 1 + the anchor slot if it does not draft)] at positions n, n+1, ..."""
    model, tok = target
    family, drafter, _, _ = trained
    prompt = heldout_prompts(tok, 1)[0]
    first = drafter.first_drafting_slot
    proposer = proposer_for(drafter)
    cached, logits, last, hidden = one_round_two_ways(model, drafter, proposer, prompt, 3, 2 + first, with_hidden=True)
    assert cached == DRAFTS_FROM_LOGITS[family](drafter, logits[first:], hidden[first:], last)


# ------------------------------------------------------------------------------------------------------- export


def vllm_parameter_names(cfg) -> set[str]:
    """What vLLM 0.32's DFlash loader (``DFlashQwen3ForCausalLM.load_weights``, qwen3_dflash.py; DSpark's
    subclasses it) loads of the backbone from our names: every name but lm_head gets ``model.``;
    ``hf_to_vllm_mapper`` stacks q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj; embed_tokens and
    mask_embedding are dropped when the checkpoint has none (the target's are shared); fc is loaded because
    use_aux_hidden_state defaults to true."""
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
    family, drafter, _, _ = trained
    cfg, folder = drafter.config, tmp_path / family
    FAMILIES[family].engine.save_exported(drafter, folder)
    state = load_file(str(folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == FAMILIES[family].engine.expected_state(cfg)
    assert as_vllm_loads_them(set(state)) == vllm_parameter_names(cfg) | VLLM_OWN_PARAMETERS[family]
    assert not any("mask_hidden" in k or "embed_tokens" in k or "lm_head" in k for k in state)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [VLLM_ARCHITECTURE[family]] and config["model_type"] == "qwen3"
    section = VLLM_SECTION[family](config)
    # vLLM's aux-hidden-state ids are target_layer_ids + 1 (eagle3_utils.get_eagle3_aux_layers_from_config)
    assert [i + 1 for i in section["target_layer_ids"]] == cfg.aux_layer_ids
    assert section["mask_token_id"] == cfg.mask_token_id
    assert "layer_types" not in config and "use_swa" not in section  # all full, non-causal
    assert config["target_hidden_size"] * len(cfg.aux_layer_ids) == state["fc.weight"].shape[1]
    assert {key: config[key] for key in VLLM_OWN_KEYS[family]} == VLLM_OWN_KEYS[family]


def test_reimported_drafter_drafts_the_same(tmp_path, target, trained):
    model, tok = target
    family, drafter, _, _ = trained
    folder = tmp_path / family
    FAMILIES[family].engine.save_exported(drafter, folder)
    (folder / "eaglekit.json").unlink()  # re-import from vLLM's config.json alone
    read = READ_CONFIG[family](folder)  # all but shared_k_norm, which the weights say
    assert dataclasses.replace(read, shared_k_norm=drafter.config.shared_k_norm) == drafter.config
    again = (
        FAMILIES[family].engine.load_exported(folder, model.get_input_embeddings().weight, model.lm_head.weight).eval()
    )
    assert again.config == drafter.config  # shared_k_norm read back from the equal weights
    for prompt in heldout_prompts(tok, 2):
        a = generate(model, prompt, 32, proposer=proposer_for(drafter), k=3)
        b = generate(model, prompt, 32, proposer=proposer_for(again), k=3)
        assert a.accepted_per_round == b.accepted_per_round


def test_a_checkpoint_that_lost_any_key_is_refused_by_name(tmp_path, target, trained):
    model, _ = target
    family, drafter, _, _ = trained
    folder = tmp_path / family
    FAMILIES[family].engine.save_exported(drafter, folder)
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    for key in state:
        save_file({k: v for k, v in state.items() if k != key}, str(weights))
        with pytest.raises(EaglekitError, match=f"missing key {re.escape(key)}"):
            FAMILIES[family].engine.load_exported(folder, embed, head)


# ---------------------------------------------------------------------------------------------------- pre-flight


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_preflight_warns_that_only_sglang_serves_a_block_drafter_on_an_mla_target(tmp_path, family):
    """Non-causal block drafts on a target with multi-head latent attention: vLLM cannot serve them
    (z-lab/dflash#62), SGLang does (sglang#29218; tests/drafters/test_sglang_forms.py): a warning naming both."""
    from transformers import DeepseekV3Config

    mla = tmp_path / "mla-target"
    DeepseekV3Config(
        vocab_size=514, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=1024,
    ).save_pretrained(mla)  # fmt: skip
    check = family_named(family).diagnosis.shape_check(
        block_run_config(tmp_path, mla, architecture=family, mask_token_id=0)
    )
    assert check.level == "warn", check
    assert "multi-head latent attention" in check.detail and "z-lab/dflash#62" in check.detail
    assert "sglang#29218" in check.detail and "SGLang" in check.remedy and "architecture: mla" in check.remedy


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_preflight_names_a_remap_vocab_a_block_drafter_would_ignore(tmp_path, tiny_target, family):
    """train.remap_vocab maps a finetuned EAGLE-3 or P-EAGLE drafter onto this run's draft vocabulary; a block drafter
    has none (it drafts over the target's): pre-flight says the key changes nothing rather than let it pass."""
    cfg = block_run_config(tmp_path, tiny_target, architecture=family, mask_token_id=0)
    assert "remap_vocab" not in family_named(family).diagnosis.shape_check(cfg).detail
    cfg.train.remap_vocab = True
    check = family_named(family).diagnosis.shape_check(cfg)
    assert check.level == "warn" and "train.remap_vocab is set" in check.detail and "changes nothing" in check.detail


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapt_remaps_the_draft_vocabulary_only_of_a_family_that_has_one(tmp_path, tiny_target, family):
    """adapt finetunes the served drafter on its traffic with the traffic's draft vocabulary (train.remap_vocab),
    which only EAGLE-3 and P-EAGLE have: for a block drafter it leaves the key off, so its run's pre-flight does not
    warn about a key adapt itself set."""
    served = tmp_path / "served"
    served.mkdir()
    data = {"run_dir": str(served), "target": {"model": str(tiny_target)}, "data": {"prompts": "p.jsonl"}}
    (served / "config.yaml").write_text(yaml.safe_dump(data | {"train": {"draft": {"architecture": family}}}))
    path = adapt.write_adapt_config(served, tmp_path / "adapt", tmp_path / "traffic", served / "export" / family, 3)
    train = yaml.safe_load(path.read_text())["train"]
    assert train["remap_vocab"] is (family in ("llama", "mla", "peagle")), train
    assert train["init_from"] == str((served / "export" / family).resolve())


# ------------------------------------------------------------------------------------------- `eaglekit run`


def run_config(run_dir: Path, target: Path, family: str, **train) -> dict:
    """`eaglekit run` of the demo's data with the family's drafter (the one trained above: 2 layers, block 4),
    120 steps of 8 rows; evaluate at K = 1 and at the block's draft slots."""
    from eaglekit.demo import demo_config

    cfg = demo_config(target)
    cfg["data"]["prompts"] = str(run_dir.parent / "prompts.jsonl")
    cfg["run_dir"] = str(run_dir)
    draft = {"architecture": family, "num_layers": 2, "block_size": BLOCK, **OWN_DRAFT[family]}
    cfg["train"].update(
        {"max_steps": 120, "batch_size": 8, "lr": 1e-3, "eval_every": 60, "save_every": 60, "draft": draft, **train}
    )
    cfg["evaluate"].update({"num_speculative_tokens": [1, draft_slots(family)], "num_samples": 4})
    cfg.pop("verify", None)
    return cfg


def run(cfg: dict, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(path)], capture_output=True, text=True, timeout=1500
    )


@pytest.fixture(scope="module", params=BLOCK_FAMILIES)
def family_run(request, tmp_path_factory, tiny_target):
    """(family, the folder, its run directory) of one `eaglekit run` (train, evaluate, export) per family."""
    from eaglekit.tiny import write_prompts

    family = request.param
    root = tmp_path_factory.mktemp(f"{family}-run")
    write_prompts(root / "prompts.jsonl", 120, seed=0)
    proc = run(run_config(root / "run", tiny_target, family), root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return family, root, root / "run"


@pytest.mark.slow
def test_run_trains_evaluates_and_exports_the_drafter(family_run):
    family, _, run_dir = family_run
    slots = draft_slots(family)
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert summary["tau"] > 1.8  # the loop's held-out block τ: the drafter learned to draft
    assert len(summary["acc_k"]) == slots  # every drafting slot of the block is measured
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert report["lossless"] and report["checkpoint_form"] == FAMILIES[family].engine.forms[0]
    taus = {(r["method"], r["k"]): r["tau"] for r in report["results"] if r["temperature"] == 0}
    assert taus["eagle", slots] > taus["eagle", 1] > taus["ngram", 1]  # "eagle": the run's drafter, whatever family
    form = FAMILIES[family].engine.forms[0]
    exported = json.loads((run_dir / "export" / form / "config.json").read_text())
    assert exported["architectures"] == [VLLM_ARCHITECTURE[family]]
    assert {key: exported[key] for key in VLLM_OWN_KEYS[family]} == VLLM_OWN_KEYS[family]
    assert f'"method": "{FAMILIES[family].engine.vllm_method(form)}"' in (run_dir / "export" / "README.md").read_text()


@pytest.mark.slow
def test_an_exported_drafter_is_reimported_for_finetuning(family_run, tiny_target):
    """The drafter exported to export/FORM finetuned from offline feature shards with packed rows (the data paths
    EAGLE-3 has): evaluate measures the re-imported starting drafter beside the finetuned one."""
    family, root, first = family_run
    slots = draft_slots(family)
    form = FAMILIES[family].engine.forms[0]
    cfg = run_config(root / "finetune", tiny_target, family, max_steps=12, init_from=str(first / "export" / form))
    cfg["train"]["packing"] = True
    cfg["train"].pop("draft")  # init_from keeps the exported drafter's own shape
    cfg["extract"] = {"mode": "offline"}
    proc = run(cfg, root / "finetune-cfg")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((root / "finetune" / "evaluate" / "report.json").read_text())
    assert report["lossless"] and report["checkpoint_form"] == form
    assert list((root / "finetune" / "extract").glob("shard-*.safetensors"))  # trained from the offline shards
    start = {r["k"]: r["tau"] for r in report["results"] if r["method"] == "eagle_start"}
    finetuned = {r["k"]: r["tau"] for r in report["results"] if r["method"] == "eagle" and r["temperature"] == 0}
    assert start[slots] > 2.0  # it arrived with its trained weights, not re-initialised
    assert finetuned[slots] > 0.9 * start[slots]  # packed offline rows kept what the drafter knew


@pytest.mark.slow
@pytest.mark.parametrize("family_run", ["dflash"], indirect=True)
def test_verify_serves_the_dflash_drafter_at_its_offline_acceptance(family_run, vllm_python):
    """verify in the real vLLM CPU build (one engine start) on the run's export, the run's config with verify added
    (the stages before it are done and skipped): served τ, every position and every verify pass equal to offline."""
    family, root, run_dir = family_run
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["verify"] = {"engine": "vllm", "num_samples": 4, "python": str(vllm_python)}
    proc = run(cfg, root / "verify-cfg")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train: done with the same inputs" in proc.stdout + proc.stderr  # the run's drafter, not a new one
    verify = json.loads((run_dir / "verify" / "report.json").read_text())
    assert verify["verdict"] == "PASS", verify
    (served,) = verify["runs"]
    assert served["form"] == FAMILIES[family].engine.forms[0] and served["k"] == draft_slots(family)
    assert served["tau"]["served"] == served["tau"]["offline"]
    assert served["rounds"]["compared"] == served["rounds"]["identical"] > 0  # every verify pass, when reported
    assert f'"method": "{family}"' in served["launch"]


@pytest.mark.slow
@pytest.mark.parametrize("family_run", ["dspark"], indirect=True)
def test_verify_of_a_dspark_drafter_on_the_cpu_build_is_a_named_refusal(family_run, vllm_python):
    _, root, run_dir = family_run
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["verify"] = {"engine": "vllm", "num_samples": 4, "python": str(vllm_python)}
    proc = run(cfg, root / "verify-cfg")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "Model Runner V1 does not support: dspark speculative decoding" in out
    assert "Triton" in out and not (run_dir / "verify" / "logs").exists()  # refused before any engine started


@pytest.mark.slow
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_kill_9_resume_of_a_block_drafter_equals_an_uninterrupted_run(tmp_path, tiny_target, family):
    """The anchors are drawn from the global RNG, which a checkpoint restores: the resumed run draws the same blocks
    and takes the same steps."""
    draft = {"architecture": family, "num_layers": 1, "block_size": BLOCK, "max_anchors": 16, **SMALL_DRAFT[family]}
    settings = {
        "batch_size": 4, "lr": 1e-3, "warmup_steps": 2, "eval_samples": 8, "max_steps": 7, "save_every": 3,
        "eval_every": 2, "log_every": 1, "keep_last": 2, "draft": draft,
    }  # fmt: skip
    whole = prepared_run(tmp_path / "whole", tiny_target, n=32, train=settings)
    killed = prepared_run(tmp_path / "killed", tiny_target, n=32, train=settings)
    ckpts, wa, wb = kill_9_then_resume(whole, killed, ("loss", "loss_k", "acc_k", "tau", "lr", "grad_norm"))
    assert family_of_folder(ckpts / "step-7") is FAMILIES[family]
    drafter = FAMILIES[family].reading.load_for_target(killed, ckpts / "step-7")
    assert (
        wa.keys() == wb.keys() == set(FAMILIES[family].engine.expected_state(drafter.config))
    )  # every weight, compared

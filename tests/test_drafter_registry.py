"""The drafter-family registry: each family is its module and one line in drafters/registry.FAMILIES (with its
train.draft model in config.DRAFT_MODELS), and the stages, the training loop, checkpointing and decoding find it
there — a family registered only in memory trains, checkpoints and exports through them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
from test_extract import prepared_run

from eaglekit import config
from eaglekit.config import DraftSection, parse_config
from eaglekit.drafters import registry
from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3.llama import Eagle3LlamaFamily
from eaglekit.drafters.family import Built, DrafterFamily, Objective, Verdict
from eaglekit.errors import UsageError
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.serving.engine_features import exported_features

MARK = "toy.json"


class ToyFamily(Eagle3LlamaFamily):
    """A family of its own name, form and folder mark; its layer is borrowed from the Llama family (what it
    builds is not the point: who asks it is). It notes every call the pipeline makes on it."""

    name = "toy"
    title = "Toy"
    forms = ("toy",)
    draft_model: Any = None  # ToyDraft, below

    def __init__(self) -> None:
        self.calls: list[str] = []

    def draft_settings(self, cfg) -> dict[str, Any]:
        return {**super().draft_settings(cfg), "architecture": "llama"}  # the layer it borrows

    def build(self, cfg, hf, d2t, t2d, embed, head, aux) -> Built:
        self.calls.append("build")
        return super().build(cfg, hf, d2t, t2d, embed, head, aux)

    def objective(self, drafter, tc, device, context=None) -> Objective:
        self.calls.append("objective")
        return super().objective(drafter, tc, device, context)

    def save_checkpoint(self, dc: Any, state: dict, out: Path) -> None:
        self.calls.append("save_checkpoint")
        super().save_checkpoint(dc, state, out)
        (out / MARK).write_text(json.dumps({"family": self.name}))

    def reads_folder(self, folder: Path) -> bool:
        return (Path(folder) / MARK).is_file()

    def load_checkpoint(self, cfg, path: Path, aux: list[int]):
        self.calls.append("load_checkpoint")
        return super().load_checkpoint(cfg, path, aux)

    def written_forms(self, requested: list[str]) -> list[str]:
        return list(self.forms)

    def vllm_method(self, form: str) -> str:
        return "toy"

    def verifier_check(self, cfg, formats: list[str]) -> Verdict:
        return Verdict("ok", "toy: no verifier")

    def sglang_check(self, cfg, formats: list[str]) -> Verdict:
        return Verdict("ok", "toy: no SGLang form")

    def export(self, ctx, load) -> dict:
        drafter, _info, _hf, _aux = load(ctx.cfg)
        self.calls.append("export")
        dest = ctx.dir / "toy"
        eagle3_checkpoint.save_legacy(drafter, dest)
        (dest / MARK).write_text(json.dumps({"family": self.name}))
        return {"formats": ["toy"], "toy": str(dest)}


class ToyDraft(DraftSection):
    """The toy's train.draft: the keys every family reads (intermediate_size, num_attention_heads), and its name."""

    architecture: Literal["toy"] = "toy"


ToyFamily.draft_model = ToyDraft


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test: its line in the registry (first: its folders are Llama ones too,
    and the table's order is the order folders are recognised in), and its model in the config's table of train.draft
    models (config.DRAFT_MODELS, read as each config loads)."""
    family = ToyFamily()
    monkeypatch.setattr(registry, "FAMILIES", {family.name: family, **registry.FAMILIES})
    monkeypatch.setitem(config.DRAFT_MODELS, family.name, ToyDraft)
    monkeypatch.setitem(config.DRAFT_KEYS, family.name, frozenset(ToyDraft.model_fields))
    return family


def test_the_registry_and_the_config_know_the_same_families():
    assert list(registry.FAMILIES) == list(config.DRAFT_MODELS) == list(config.DRAFT_KEYS)
    for name, family in registry.FAMILIES.items():
        assert family.name == name and family.draft_model is config.DRAFT_MODELS[name]
        assert config.DRAFT_KEYS[name] == set(family.draft_model.model_fields), name
    assert registry.family_named(None) is registry.FAMILIES["llama"]  # architecture unset: llama
    with pytest.raises(UsageError, match="not a drafter family"):
        registry.family_named("toy")


def test_a_family_in_the_table_is_one_the_config_accepts_with_its_own_keys(toy):
    base = {"run_dir": "r", "target": {"model": "m"}, "data": {"prompts": "p.jsonl"}}
    cfg = parse_config({**base, "train": {"draft": {"architecture": "toy", "intermediate_size": 64}}})
    assert isinstance(cfg.train.draft, ToyDraft) and registry.family_named(cfg.train.draft.architecture) is toy
    with pytest.raises(UsageError, match=r"architecture toy does not read block_size \(dflash, dspark, dflash2\)"):
        parse_config({**base, "train": {"draft": {"architecture": "toy", "block_size": 4}}})
    with pytest.raises(UsageError, match="'toy2' is not a drafter family"):
        parse_config({**base, "train": {"draft": {"architecture": "toy2"}}})


def test_a_family_registered_in_memory_trains_checkpoints_and_exports(tmp_path, tiny_target, toy):
    """train and export run the toy family's build, objective, checkpoint writer, loader and export: nothing in
    them names it."""
    family: DrafterFamily = toy  # the interface, structurally (mypy holds the real families to it in registry.py)
    assert family.forms == ("toy",)
    train = {"ttt": {"steps": 2}, "batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "max_steps": 2, "eval_every": 2,
             "save_every": 2, "eval_samples": 4, "draft": {"architecture": "toy", "intermediate_size": 64}}  # fmt: skip
    cfg = prepared_run(tmp_path, tiny_target, n=24, train=train)
    with RunDir(cfg.run_dir).lock:
        trained = run_stage(cfg, "train", skip_preflight=True)
        best = Path(cfg.run_dir) / "train" / "checkpoints" / "best"
        assert trained["counts"]["steps"] == 2
        assert toy.calls[:2] == ["build", "objective"] and "save_checkpoint" in toy.calls
        assert registry.family_of_folder(best) is toy  # the checkpoint is the toy family's, by its own mark
        assert registry.family_of_run(cfg) is toy
        exported = run_stage(cfg, "export", skip_preflight=True)
    assert toy.calls[-2:] == ["load_checkpoint", "export"]
    assert exported["counts"]["formats"] == ["toy"]
    folder = Path(cfg.run_dir) / "export" / "toy"
    assert registry.family_of_folder(folder) is toy
    drafter, _ = eagle3_checkpoint.load_drafter(folder)
    assert drafter.config.intermediate_size == 64  # the shape the config asked of it
    assert registry.vllm_method("toy") == "toy"


def test_each_family_plans_the_configs_the_engine_checks_read_as_its_forms(tmp_path, tiny_target):
    """export's engine-feature check reads each form's config.json as the family plans it (it told the block
    drafters from EAGLE-3 by their config's class before): each form reads back as that form, with its window."""
    expected = {"llama": {"eagle3": "eagle3", "speculators": "speculators"}, "mla": {"eagle3": "mla"},
                "dflash": {"dflash": "dflash"}, "dspark": {"dspark": "dspark"}, "dflash2": {"dflash2": "dflash2"}}  # fmt: skip
    both = ["eagle3", "speculators"]  # export.formats' default: each family writes those it has
    for name, family in registry.FAMILIES.items():
        window = {"sliding_window": 64} if family.windowed else {}
        cfg = parse_config(
            {
                "run_dir": str(tmp_path / "r"),
                "target": {"model": str(tiny_target)},
                "data": {"prompts": "p.jsonl"},
                "vocab": {"draft_vocab_size": 80},
                "train": {"draft": {"architecture": name, **window}},
            }  # fmt: skip
        )
        planned = family.planned_configs(registry.fresh_drafter_config(cfg), family.written_forms(both), 3)
        read = {form: exported_features(config) for form, config in planned.items()}
        assert {form: found for form, (found, _) in read.items()} == expected[name], name
        assert all(("sliding_window" in features) == bool(window) for _, features in read.values()), name

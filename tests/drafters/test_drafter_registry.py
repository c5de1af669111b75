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
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.drafters.family import DrafterFamily, Verdict, Written
from eaglekit.errors import UsageError
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.serving.engine_features import exported_features
from eaglekit.training.objective import Built, Objective

MARK = "toy.json"


class ToyDrafting(Eagle3LlamaFamily):
    """The toy's sizing, training, reading and diagnosis: the Llama family's, borrowed (what it builds is not the
    point: who asks it is), its folders marked as the toy's. It notes every call the pipeline makes on it."""

    name = "toy"
    title = "Toy"
    forms = ("toy",)

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

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


class ToyForms:
    """The toy's export: one form of its own, its folder marked; the model card and the commands are the export
    stage's."""

    forms = ("toy",)
    vllm_cpu_refusal = None

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def written_forms(self, requested: list[str]) -> list[str]:
        return list(self.forms)

    def planned_configs(self, dc: Any, forms: list[str], k: int) -> dict[str, dict]:
        return {}

    def vllm_method(self, form: str) -> str:
        return "toy"

    def verifier_check(self, cfg, formats: list[str]) -> Verdict:
        return Verdict("ok", "toy: no verifier")

    def sglang_check(self, cfg, formats: list[str]) -> Verdict:
        return Verdict("ok", "toy: no SGLang form")

    def write(self, ctx, load, requested: list[str]) -> Written:
        drafter, info, _hf, _aux = load(ctx.cfg)
        self.calls.append("write")
        dest = ctx.dir / "toy"
        eagle3_checkpoint.save_legacy(drafter, dest)
        (dest / MARK).write_text(json.dumps({"family": "toy"}))
        command = f'vllm serve {ctx.cfg.target.model} --speculative-config \'{{"method": "toy"}}\''
        return Written(drafter, info, {"toy": dest}, [("vLLM", command)], [], "Toy drafter", "a toy", {"toy": "toy"})


class ToyDraft(DraftSection):
    """The toy's train.draft: the keys every family reads (intermediate_size, num_attention_heads), and its name."""

    architecture: Literal["toy"] = "toy"


def toy_family() -> DrafterFamily:
    """The toy as a family: its name, its config model, and its roles."""
    calls: list[str] = []
    drafting = ToyDrafting(calls)
    return DrafterFamily(
        name="toy",
        draft_model=ToyDraft,
        drafter_class=Eagle3Drafter,
        windowed=False,
        sizing=drafting,
        training=drafting,
        reading=drafting,
        engine=ToyForms(calls),
        diagnosis=drafting,
    )


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test: its line in the registry (first: its folders are Llama ones too,
    and the table's order is the order folders are recognised in), and its model in the config's table of train.draft
    models (config.DRAFT_MODELS, read as each config loads)."""
    family = toy_family()
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
    assert toy.engine.forms == ("toy",)
    calls = toy.engine.calls  # type: ignore[attr-defined]  # the toy's own record
    train = {"ttt": {"steps": 2}, "batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "max_steps": 2, "eval_every": 2,
             "save_every": 2, "eval_samples": 4, "draft": {"architecture": "toy", "intermediate_size": 64}}  # fmt: skip
    cfg = prepared_run(tmp_path, tiny_target, n=24, train=train)
    with RunDir(cfg.run_dir).lock:
        trained = run_stage(cfg, "train", skip_preflight=True)
        best = Path(cfg.run_dir) / "train" / "checkpoints" / "best"
        assert trained["counts"]["steps"] == 2
        assert calls[:2] == ["build", "objective"] and "save_checkpoint" in calls
        assert registry.family_of_folder(best) is toy  # the checkpoint is the toy family's, by its own mark
        assert registry.family_of_run(cfg) is toy
        exported = run_stage(cfg, "export", skip_preflight=True)
    assert calls[-2:] == ["load_checkpoint", "write"]
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
                "peagle": {"eagle3": "eagle3", "speculators": "speculators"},
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
        planned = family.engine.planned_configs(
            registry.fresh_drafter_config(cfg), family.engine.written_forms(both), 3
        )
        read = {form: exported_features(config) for form, config in planned.items()}
        assert {form: found for form, (found, _) in read.items()} == expected[name], name
        assert all(("sliding_window" in features) == bool(window) for _, features in read.values()), name

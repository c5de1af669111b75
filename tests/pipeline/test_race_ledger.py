"""The τ race's ledger (benchmarks/tau_vs_speculators.py): a side and seed finished in one session is read back in
a later one only under the same settings — the same tiny target's weights above all, which differ between CPU
kinds — so seeds run on different machines or recipes never mix in one table."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eaglekit.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def race_module():
    spec = importlib.util.spec_from_file_location("tau_vs_speculators", ROOT / "benchmarks" / "tau_vs_speculators.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def race(tmp_path: Path, weight: float = 1.0, tokens: int = 7, **changes):
    """A config and the race's arguments as main() parses them, around a stand-in target whose weights are one
    tensor of ``weight`` and a run folder whose prepared data is one tensor of ``tokens``."""
    target, run = tmp_path / f"target-{weight}", tmp_path / f"run-{tokens}"
    for folder in (target, run / "prepare", run / "vocab"):
        folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((4,), weight)}, str(target / "model.safetensors"))
    save_file({"input_ids": torch.full((8,), tokens)}, str(run / "prepare" / "tokens.safetensors"))
    save_file({"d2t": torch.arange(4)}, str(run / "vocab" / "vocab.safetensors"))
    cfg = SimpleNamespace(target=SimpleNamespace(model=str(target)), run_dir=str(run), train=TrainConfig(seed=3))
    args = argparse.Namespace(
        target="tasks",
        generate_temperature=0.0,
        prompts=1600,
        eval_fraction=0.05,
        draft_vocab=200,
        intermediate=256,
        steps=300,
        seq=2048,
        lr=3e-3,
        warmup=20,
        ttt_steps=4,
        decay=0.8,
        eval_prompts=40,
        max_new_tokens=160,
        served_temperature=0.0,
        threads=1,
        seed=0,
        ks=[1, 3],
        temperatures=[0.0],
        ablate=[],
        ledger=tmp_path / "ledger.jsonl",
    )
    for key, value in changes.items():
        setattr(args, key, value)
    return cfg, args


RUN = {
    "tau": {"1@0": 1.9, "3@0": 3.6},
    "ngram": {},
    "conditional": {"3@0": [0.9, 0.8, 0.7]},
    "prompts": 40,
    "vllm": {1: 1.92, 3: 3.65},
    "seconds": 12.0,
}


def test_a_finished_seed_is_read_back_under_the_same_settings_only(tmp_path):
    m = race_module()
    cfg, args = race(tmp_path)
    m.to_ledger(cfg, args, "eaglekit-lr0.003", 1, RUN)
    m.to_ledger(cfg, args, "matched", 1, RUN | {"tau": {"1@0": 1.8, "3@0": 3.1}})

    back = m.from_ledger(cfg, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True)
    assert back is not None and back["tau"] == RUN["tau"]
    assert back["vllm"] == {1: 1.92, 3: 3.65}  # JSON's string keys back to K as the report reads them
    assert m.from_ledger(cfg, args, "matched", 1, use_vllm=True, reuse=True)["tau"]["3@0"] == 3.1

    # nothing is read back unless asked, for another seed, side, target's weights, setting or recipe
    assert m.from_ledger(cfg, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=False) is None
    assert m.from_ledger(cfg, args, "eaglekit-lr0.003", 2, use_vllm=True, reuse=True) is None
    assert m.from_ledger(cfg, args, "shipped", 1, use_vllm=True, reuse=True) is None
    other_machine, _ = race(tmp_path, weight=1.0001)
    assert m.from_ledger(other_machine, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is None
    other_replies, _ = race(tmp_path, tokens=8)
    assert m.from_ledger(other_replies, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is None
    _, two_threads = race(tmp_path, threads=2)
    assert m.from_ledger(cfg, two_threads, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is None
    _, longer = race(tmp_path, steps=600)
    assert m.from_ledger(cfg, longer, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is None
    other_recipe = SimpleNamespace(**{**vars(cfg), "train": TrainConfig(seed=3, ttt={"loss": "nla"})})
    assert m.from_ledger(other_recipe, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is None
    # the training seed is the ledger line's own field, not part of the recipe
    reseeded = SimpleNamespace(**{**vars(cfg), "train": TrainConfig(seed=1)})
    assert m.from_ledger(reseeded, args, "eaglekit-lr0.003", 1, use_vllm=True, reuse=True) is not None

    # a run that did not measure all that is asked is run again
    _, deeper = race(tmp_path, ks=[1, 3, 5])
    assert m.from_ledger(cfg, deeper, "eaglekit-lr0.003", 1, use_vllm=False, reuse=True) is None


def test_served_figures_are_needed_where_vllm_is_used_and_the_last_line_wins(tmp_path):
    m = race_module()
    cfg, args = race(tmp_path)
    m.to_ledger(cfg, args, "matched", 0, RUN | {"vllm": {}})
    assert m.from_ledger(cfg, args, "matched", 0, use_vllm=True, reuse=True) is None
    assert m.from_ledger(cfg, args, "matched", 0, use_vllm=False, reuse=True) is not None
    m.to_ledger(cfg, args, "matched", 0, RUN)
    m.to_ledger(cfg, args, "matched", 0, RUN | {"tau": {"1@0": 1.7, "3@0": 2.9}})
    again = m.from_ledger(cfg, args, "matched", 0, use_vllm=True, reuse=True)
    assert again["tau"]["3@0"] == 2.9 and again["vllm"] == {1: 1.92, 3: 3.65}


def test_only_runs_trained_here_are_appended_and_the_file_stays_strict_json(tmp_path):
    m = race_module()
    cfg, args = race(tmp_path)
    m.to_ledger(cfg, args, "matched", 0, {"error": "RuntimeError: out of memory"})
    # reused from --out's folders (matched there on name and seed only): seconds are NaN
    m.to_ledger(cfg, args, "matched", 0, RUN | {"seconds": float("nan")})
    assert not args.ledger.exists()
    m.to_ledger(cfg, args, "matched", 0, RUN | {"vllm": {1: float("nan"), 3: 3.65}})  # K=1 drew nothing
    reused = m.from_ledger(cfg, args, "matched", 0, use_vllm=False, reuse=True)
    m.to_ledger(cfg, args, "matched", 0, reused)
    lines = args.ledger.read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"{c} in the ledger: not strict JSON"))
    assert entry["seed"] == 0 and entry["settings"]["side"] == "matched" and entry["cpu"]
    assert entry["run"]["vllm"] == {"1": None, "3": 3.65}
    # a served K without a figure is not a served figure
    assert m.from_ledger(cfg, args, "matched", 0, use_vllm=True, reuse=True) is None


def test_a_line_that_does_not_parse_is_passed_over(tmp_path, capsys):
    m = race_module()
    cfg, args = race(tmp_path)
    m.to_ledger(cfg, args, "matched", 0, RUN)
    with open(args.ledger, "a") as f:
        f.write('{"date": "2026-12-05 12:00", "seed": 0, "settings": {"side": "mat\n<<<<<<< HEAD\n')
    assert m.from_ledger(cfg, args, "matched", 0, use_vllm=True, reuse=True)["tau"] == RUN["tau"]
    assert "ledger.jsonl:2: not a ledger entry" in capsys.readouterr().out

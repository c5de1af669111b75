"""Situational awareness before training: benchmark suites read in the layouts users have on disk, a hub id as the
target resolved to its cached snapshot, and a draft vocabulary that another run's tokens made."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.suites import load_suite
from eaglekit.data.tokens import write_token_store
from eaglekit.errors import UsageError
from eaglekit.preflight import files, run_directory
from eaglekit.stages import evaluate, train
from eaglekit.stages import vocab as vocab_stage

# ------------------------------------------------------------------------------ suites checked before training

FASTCHAT_MT_BENCH = [  # FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl rows
    {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it in limericks."]},
    {"question_id": 111, "category": "math", "turns": ["Area of a triangle?", "Its circle?"], "reference": ["3"]},
]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def suites_check(tmp_path, suites):
    cfg = parse_config(
        {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}, "evaluate": {"suites": suites}},
        base_dir=tmp_path,
    )
    return evaluate.benchmark_suites(SimpleNamespace(cfg=cfg))


def test_mt_bench_reads_fastchats_question_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "mt_bench" / "question.jsonl", FASTCHAT_MT_BENCH)
    items = load_suite("mt_bench", path=str(path))
    assert [i.turns for i in items] == [r["turns"] for r in FASTCHAT_MT_BENCH]
    assert [i.id for i in items] == ["mt_bench:81", "mt_bench:111"]
    result = suites_check(tmp_path, [{"name": "mt_bench", "path": str(path)}])
    assert result.status == "ok" and "mt_bench: 2 prompts read" in result.detail
    # the folder of FastChat's repository, its answers and judgments beside the questions
    write_jsonl(path.parent / "model_answer" / "vicuna.jsonl", [{"question_id": 81, "choices": [{"turns": ["x"]}]}])
    write_jsonl(path.parent / "reference_answer" / "gpt-4.jsonl", [{"question_id": 111, "answer_id": "a"}])
    assert load_suite("mt_bench", path=str(path.parent)) == items


def test_a_cloned_hub_dataset_folder_is_read_by_its_split_and_config(tmp_path):
    gsm = tmp_path / "gsm8k"  # git clone https://huggingface.co/datasets/openai/gsm8k
    (gsm / ".git").mkdir(parents=True)
    (gsm / "README.md").write_text("---\nconfigs: []\n---\n")
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            rows = [{"question": f"{config} {split} q{i}?", "answer": "#### 1"} for i in range(3)]
            write_parquet(gsm / config / f"{split}-00000-of-00001.parquet", rows)
    items = load_suite("gsm8k", path=str(gsm))
    assert [i.turns[0] for i in items] == ["main test q0?", "main test q1?", "main test q2?"]

    alpaca = tmp_path / "alpaca"  # data/ with the hub's shard names, one split: that split
    write_parquet(alpaca / "data" / "train-00000-of-00002.parquet", [{"instruction": "a", "input": "", "output": ""}])
    write_jsonl(alpaca / "data" / "train-00001-of-00002.jsonl", [{"instruction": "b", "input": "x", "output": ""}])
    assert sorted(i.turns[0] for i in load_suite("alpaca", path=str(alpaca))) == ["a", "b\n\nx"]

    math = tmp_path / "MATH-500"  # test.jsonl at the top, as HuggingFaceH4/MATH-500 has it
    write_jsonl(math / "test.jsonl", [{"problem": "1+1?", "answer": "2", "unique_id": "test/a/1.json"}])
    assert load_suite("math500", path=str(math))[0].id == "math500:test/a/1.json"

    result = suites_check(tmp_path, [{"name": "gsm8k", "path": str(gsm)}, {"name": "math500", "path": str(math)}])
    assert result.status == "ok", result


def test_preflight_reads_each_local_copy_and_names_the_file_and_the_missing_column(tmp_path):
    chat = write_jsonl(tmp_path / "mt.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    result = suites_check(tmp_path, ["gsm8k", {"name": "mt_bench", "path": str(chat)}])
    assert result.status == "fail"
    assert str(chat) in result.detail and "needs the column(s) prompt or turns" in result.detail
    assert "HuggingFaceH4/mt_bench_prompts" in result.remedy

    clone = tmp_path / "humaneval"
    write_parquet(clone / "data" / "train-00000-of-00001.parquet", [{"text": "x"}])
    write_parquet(clone / "data" / "validation-00000-of-00001.parquet", [{"text": "y"}])
    result = suites_check(tmp_path, [{"name": "humaneval", "path": str(clone)}])
    assert result.status == "fail" and "no 'test' split" in result.detail and "train" in result.detail

    empty = tmp_path / "empty"
    (empty / ".git").mkdir(parents=True)
    (empty / "README.md").write_text("# a dataset card only\n")
    result = suites_check(tmp_path, [{"name": "gsm8k", "path": str(empty)}])
    assert result.status == "fail" and "no .parquet, .jsonl or .json data files" in result.detail

    lfs = tmp_path / "lfs"  # cloned without git-lfs: pointers where the parquet files should be
    (lfs / "data").mkdir(parents=True)
    (lfs / "data" / "test-00000-of-00001.parquet").write_text("version https://git-lfs.github.com/spec/v1\noid x\n")
    result = suites_check(tmp_path, [{"name": "math500", "path": str(lfs)}])
    assert result.status == "fail" and "Git LFS pointer" in result.detail and "git lfs pull" in result.remedy


def test_the_check_is_part_of_evaluates_preflight(tmp_path):
    cfg = parse_config(
        {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}, "evaluate": {"suites": ["gsm8k"]}},
        base_dir=tmp_path,
    )
    assert evaluate.benchmark_suites in evaluate.checks(cfg)
    with pytest.raises(UsageError, match="turns"):
        load_suite("mt_bench", path=str(write_jsonl(tmp_path / "x.jsonl", [{"q": "a"}])))


# ------------------------------------------------------------------------------ a hub id as the target

REPO = "acme/tiny-target"


@pytest.fixture
def hub_target(tmp_path, tiny_target, monkeypatch) -> Path:
    """The tiny target published with its weights in two shards, downloaded by huggingface_hub into a fresh cache
    (HF_HOME) from a local hub; afterwards HF_HUB_OFFLINE is set, as on a machine without network. Returns the
    snapshot folder."""
    from huggingface_hub import snapshot_download
    from support.local_hub import LocalHub

    repo = tmp_path / "published"
    repo.mkdir()
    for f in tiny_target.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, repo / f.name)
    tensors = load_file(str(tiny_target / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(repo / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub({REPO: repo}) as hub:
        snapshot = Path(snapshot_download(REPO, endpoint=hub.url, cache_dir=str(tmp_path / "hf" / "hub")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def target_cfg(tmp_path, model: str, **vocab):
    return parse_config(
        {"run_dir": "run", "target": {"model": model}, "data": {"prompts": "p.jsonl"}, "vocab": vocab},
        base_dir=tmp_path,
    )


def test_a_hub_id_target_in_the_cache_gets_through_vocab(tmp_path, hub_target, tiny_target):
    cfg = target_cfg(tmp_path, REPO, draft_vocab_size=32)
    ctx = SimpleNamespace(cfg=cfg)
    vocab_size = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    check = vocab_stage.draft_vocab_fits(ctx)
    assert check.status == "ok" and f"32 of {vocab_size}" in check.detail
    assert vocab_stage.target_vocab_size(REPO) == vocab_size
    folder, weights = run_directory.target_folder(ctx), files.target_weights(ctx)
    assert folder.status == "ok" and str(hub_target) in folder.detail
    assert weights[0].status == "ok" and "2 safetensors files" in weights[0].detail

    # the vocab stage itself reads the target's config from the snapshot
    run = tmp_path / "run"
    write_token_store(run / "prepare" / "tokens.safetensors", [("a", [1, 2, 3, 2], [0, 1, 1, 1])])
    vocab_stage.run(pipeline.make_context(cfg, "vocab"))
    assert json.loads((run / "vocab" / "stats.json").read_text())["target_vocab_size"] == vocab_size


def test_a_half_downloaded_hub_cache_is_named_before_any_stage(tmp_path, hub_target):
    ctx = SimpleNamespace(cfg=target_cfg(tmp_path, REPO))
    link = hub_target / "model-00002-of-00002.safetensors"
    blob = link.resolve()
    link.unlink()  # what an interrupted huggingface_hub download leaves: no link yet, the blob still .incomplete
    blob.rename(blob.with_name(blob.name + ".incomplete"))

    weights = files.target_weights(ctx)[0]
    assert weights.status == "fail"
    assert ".incomplete" in weights.detail and "model-00002-of-00002.safetensors" in weights.detail
    folder = run_directory.target_folder(ctx)
    assert folder.status == "fail" and "misses 1 of 2 weight shards" in folder.detail

    blob.with_name(blob.name + ".incomplete").unlink()  # the shard simply absent: still named
    weights = files.target_weights(ctx)[0]
    assert weights.status == "fail" and "1 of 2 shards" in weights.detail and "model-00002" in weights.detail


def test_a_hub_id_not_in_the_cache_offline_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check = vocab_stage.draft_vocab_fits(SimpleNamespace(cfg=target_cfg(tmp_path, "acme/absent-model")))
    assert check.status == "fail"
    assert "not in the Hugging Face cache" in check.detail and "HF_HUB_OFFLINE" in check.detail
    assert "hf download acme/absent-model" in check.remedy
    folder = run_directory.target_folder(SimpleNamespace(cfg=target_cfg(tmp_path, "acme/absent-model")))
    assert folder.status == "fail" and "HF_HUB_OFFLINE" in folder.detail
    assert str(tmp_path / "hf" / "hub" / "models--acme--absent-model") in folder.detail


# ------------------------------------------------------------------------------ a foreign draft vocabulary


def built_run(tmp_path, name: str, tiny_target, samples):
    cfg = parse_config(
        {
            "run_dir": name,
            "target": {"model": str(tiny_target)},
            "data": {"prompts": "p.jsonl"},
            "vocab": {"draft_vocab_size": 16},
        },
        base_dir=tmp_path,
    )
    write_token_store(tmp_path / name / "prepare" / "tokens.safetensors", samples)
    vocab_stage.run(pipeline.make_context(cfg, "vocab"))
    return cfg


def test_another_runs_vocabulary_is_refused_before_training(tmp_path, tiny_target):
    ours = built_run(tmp_path, "ours", tiny_target, [("a", list(range(40)), [1] * 40)])
    theirs = built_run(tmp_path, "theirs", tiny_target, [("b", list(range(60, 100)), [1] * 40)])
    ctx = pipeline.make_context(ours, "train")
    assert train.draft_vocab_origin(ctx).status == "ok"

    shutil.copy(tmp_path / "theirs" / "vocab" / "vocab.safetensors", tmp_path / "ours" / "vocab" / "vocab.safetensors")
    check = train.draft_vocab_origin(ctx)
    assert check.status == "fail"
    assert str(tmp_path / "theirs" / "prepare" / "tokens.safetensors") in check.detail  # whose tokens it counted
    assert str(tmp_path / "ours" / "prepare" / "tokens.safetensors") in check.detail
    assert "eaglekit vocab CONFIG --force" in check.remedy
    assert draft_vocab_origin_in_preflight(ctx).status == "fail"

    # ahead of `eaglekit run`, a vocab stage that will run first rebuilds it: nothing to refuse yet
    assert train.draft_vocab_origin(dataclasses.replace(ctx, pending=("vocab",))).status == "skip"
    assert theirs.vocab == ours.vocab


def test_a_vocabulary_built_with_other_settings_or_without_a_record(tmp_path, tiny_target):
    ours = built_run(tmp_path, "ours", tiny_target, [("a", list(range(40)), [1] * 40)])
    smaller = ours.model_copy(update={"vocab": ours.vocab.model_copy(update={"draft_vocab_size": 8})})
    check = train.draft_vocab_origin(pipeline.make_context(smaller, "train"))
    assert check.status == "fail" and "draft_vocab_size 16 (now 8)" in check.detail

    path = tmp_path / "ours" / "vocab" / "vocab.safetensors"
    save_file(load_file(str(path)), str(path))  # as an older eaglekit wrote it: no record of its origin
    check = train.draft_vocab_origin(pipeline.make_context(ours, "train"))
    assert check.status == "warn" and "records no origin" in check.detail


def draft_vocab_origin_in_preflight(ctx):
    return next(r for r in pipeline.run_preflight(ctx) if r.name == "draft vocabulary")

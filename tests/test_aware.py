"""Situational awareness before training: benchmark suites read in the layouts users have on disk, a hub id as the
target resolved to its cached snapshot, and a draft vocabulary that another run's tokens made."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglekit.config import parse_config
from eaglekit.data.suites import load_suite
from eaglekit.errors import UsageError
from eaglekit.stages import evaluate

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

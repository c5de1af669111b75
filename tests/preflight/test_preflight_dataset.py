"""The prompts dataset check: rows counted cheaply per format, bad rows named by file:line (fail or warn per
data.on_bad_row), rows without a user turn, duplicates — and a clean dataset passing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.preflight import dataset


def rows(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
        for i in range(start, start + n)
    ]


def check(tmp_path, name: str, lines: list[str] | None = None, **data):
    path = tmp_path / name
    if lines is not None:
        path.write_text("".join(line + "\n" for line in lines))
    cfg = parse_config(
        {"run_dir": "run", "target": {"model": "org/t"}, "data": {"prompts": str(path), **data}}, base_dir=tmp_path
    )
    return dataset.prompts(pipeline.make_context(cfg, "generate"))


def test_a_clean_jsonl_dataset_passes_with_its_row_count(tmp_path):
    result = check(tmp_path, "p.jsonl", rows(50))
    assert result.status == "ok" and "50 rows (lines)" in result.detail and "50 prompts" in result.detail


def test_a_bad_row_fails_naming_file_and_line_when_on_bad_row_is_fail(tmp_path):
    lines = rows(3) + ["{oops"] + rows(3, 3)
    result = check(tmp_path, "p.jsonl", lines)
    assert result.status == "fail" and f"{tmp_path / 'p.jsonl'}:4: not valid JSON" in result.detail
    assert "on_bad_row: skip" in result.remedy


def test_bad_rows_and_missing_user_turns_warn_when_they_are_skipped(tmp_path):
    no_user = json.dumps({"messages": [{"role": "system", "content": "be brief"}]})
    result = check(tmp_path, "p.jsonl", rows(6) + [no_user, no_user], on_bad_row="skip")
    assert result.status == "warn" and "2 bad row(s)" in result.detail and "p.jsonl:7" in result.detail
    assert "25.0% without a user turn" in result.detail


def test_many_duplicates_warn(tmp_path):
    result = check(tmp_path, "p.jsonl", rows(10) + rows(10))
    assert result.status == "warn" and "50.0% duplicates" in result.detail


def test_missing_file_and_empty_file_fail(tmp_path):
    assert check(tmp_path, "absent.jsonl").status == "fail"
    empty = check(tmp_path, "empty.jsonl", [])
    assert empty.status == "fail" and "empty.jsonl" in empty.detail


def test_max_samples_beyond_the_file_is_said(tmp_path):
    result = check(tmp_path, "p.jsonl", rows(5), max_samples=100)
    assert result.status == "ok" and "data.max_samples 100 is more than the file holds" in result.detail


def test_rows_are_counted_from_parquet_metadata_and_a_jsonl_without_final_newline(tmp_path):
    table = pa.table({"conversations": [[{"from": "human", "value": f"question {i}"}] for i in range(7)]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert dataset.count_rows(tmp_path / "p.parquet") == (7, "Parquet metadata")
    (tmp_path / "q.jsonl").write_text("\n".join(rows(4)))
    assert dataset.count_rows(tmp_path / "q.jsonl") == (4, "lines")
    assert check(tmp_path, "p.parquet").status == "ok"


def test_a_large_jsonl_is_estimated_from_its_head(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "EXACT_COUNT_LIMIT", 1000)
    (tmp_path / "big.jsonl").write_text("".join(line + "\n" for line in rows(200)))
    n, how = dataset.count_rows(tmp_path / "big.jsonl")
    assert n == pytest.approx(200, rel=0.02) and how.startswith("estimated from the first 64 MB")

"""Loading prompt datasets: every supported shape, truncation at the last user turn, ids, duplicates, bad rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglekit.data.prompts import load_prompts, peek_prompts
from eaglekit.errors import UsageError

SHAREGPT = {"id": "a1", "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
GOOD = [
    {"id": 7, "conversations": [{"from": "human", "value": "first"}]},
    {"id": 8, "messages": [{"role": "user", "content": "second"}]},
]


def write_jsonl(path, rows):
    with open(path, "wb") as f:
        for row in rows:
            line = row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()
            f.write(line + b"\n")
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_dataset(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


# --- shapes ---------------------------------------------------------------------------------------------


def test_jsonl_sharegpt_and_openai_shapes(tmp_path):
    ps = load_prompts(write_jsonl(tmp_path / "p.jsonl", [SHAREGPT, OPENAI]))
    assert [r.messages for r in ps.records] == [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    ]
    assert ps.records[0].id == "a1" and ps.records[0].source == f"{tmp_path / 'p.jsonl'}:1"
    assert ps.records[1].source.endswith("p.jsonl:2")
    assert ps.total_rows == 2 and not ps.bad_rows and ps.duplicates == 0


def test_json_list(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([SHAREGPT, OPENAI], indent=2))
    ps = load_prompts(path)
    assert [r.id for r in ps.records][0] == "a1"
    assert [r.source for r in ps.records] == [f"{path}:row 0", f"{path}:row 1"]


def test_parquet(tmp_path):
    rows = [
        SHAREGPT,
        {"id": "b2", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]},
    ]
    ps = load_prompts(write_parquet(tmp_path / "p.parquet", rows))
    assert [r.id for r in ps.records] == ["a1", "b2"]
    assert ps.records[1].messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert ps.records[1].source.endswith("p.parquet:row 1")


def test_parquet_struct_with_both_key_styles(tmp_path):
    # Arrow merges turn keys into one struct: each turn carries all four keys, the unused ones null.
    rows = [{"conversations": [{"from": "human", "value": "q"}]}, {"conversations": [{"role": "user", "content": "r"}]}]
    ps = load_prompts(write_parquet(tmp_path / "p.parquet", rows))
    assert [r.messages[0]["content"] for r in ps.records] == ["q", "r"]


def test_datasets_folder_and_dataset_dict(tmp_path):
    import datasets

    ps = load_prompts(save_dataset(tmp_path / "ds", [OPENAI, {"messages": [{"role": "user", "content": "x"}]}]))
    assert [r.messages[-1]["content"] for r in ps.records] == ["2+2?", "x"] and ps.split is None
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([SHAREGPT]), "test": datasets.Dataset.from_list([OPENAI])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    ps = load_prompts(tmp_path / "dd")
    assert ps.split == "train" and [r.id for r in ps.records] == ["a1"] and "split 'train'" in ps.summary()
    datasets.DatasetDict({"only": datasets.Dataset.from_list([OPENAI])}).save_to_disk(str(tmp_path / "one"))
    assert load_prompts(tmp_path / "one").split == "only"


def test_openai_text_parts_are_joined(tmp_path):
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert load_prompts(write_jsonl(tmp_path / "p.jsonl", [row])).records[0].messages[0]["content"] == "ab"


# --- prompt shape, ids, duplicates -------------------------------------------------------------------------


def test_prompt_ends_at_the_last_user_turn(tmp_path):
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "user", "value": "Q2"},
            {"from": "assistant", "value": "A2"},
            {"from": "gpt", "value": ""},
        ]
    }
    (record,) = load_prompts(write_jsonl(tmp_path / "p.jsonl", [row])).records
    assert record.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_ids_are_stable_and_hashed_when_absent(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)] + [{"id": 42, **OPENAI}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    first, second = load_prompts(path), load_prompts(path)
    ids = [r.id for r in first.records]
    assert ids == [r.id for r in second.records]
    assert ids[3] == "42" and len(set(ids)) == 4 and all(len(i) == 16 for i in ids[:3])
    # The hash depends on the normalised messages, not the file's spelling of them.
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "q0"}]}])
    assert load_prompts(sharegpt).records[0].id == ids[0]


def test_duplicates_are_counted_and_skipped(tmp_path):
    rows = [
        SHAREGPT,
        SHAREGPT,  # same id and prompt
        {"id": "other", **{k: v for k, v in SHAREGPT.items() if k != "id"}},  # same prompt, new id
        {"id": "a1", "messages": [{"role": "user", "content": "different"}]},  # same id, new prompt
        OPENAI,
    ]
    ps = load_prompts(write_jsonl(tmp_path / "p.jsonl", rows))
    assert [r.id for r in ps.records] == ["a1", ps.records[1].id] and ps.records[1].messages[0]["role"] == "system"
    assert ps.duplicates == 3 and ps.total_rows == 5 and "3 duplicates skipped" in ps.summary()


def test_max_samples_stops_reading_early(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", GOOD + ["{broken"])
    ps = load_prompts(path, max_samples=2)
    assert len(ps.records) == 2 and ps.total_rows == 2
    assert [r.id for r in peek_prompts(path, n=1)] == ["7"]
    with pytest.raises(UsageError, match=r"p\.jsonl:3"):
        load_prompts(path)


# --- malformed inputs -------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "q"}]
# (name, bad row, where it lands, what the message says). The bad row follows the two GOOD rows.
ROW_ERRORS = [
    ("bad json", '{"conversations": [', "jsonl", r":3: not valid JSON"),
    ("non-object line", "[1, 2]", "jsonl", r":3: expected a JSON object, got a list"),
    ("number line", "42", "jsonl", r":3: expected a JSON object, got int"),
    ("not utf-8", b'{"messages": "\xff\xfe"}', "jsonl", r":3: line is not UTF-8"),
    ("missing conversations", {"text": "hi"}, "jsonl", r":3: no 'conversations' or 'messages' field \(fields: text\)"),
    ("conversations not a list", {"conversations": "hi"}, "jsonl", r":3: 'conversations' must be a non-empty list"),
    ("empty messages", {"messages": []}, "jsonl", r":3: 'messages' must be a non-empty list"),
    ("turn not an object", {"messages": ["hi"]}, "jsonl", r":3: messages\[0\] must be an object"),
    (
        "unknown role",
        {"conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "x"}]},
        "jsonl",
        r":3: conversations\[1\] has unknown role 'tool'",
    ),
    ("missing role", {"messages": [{"content": "q"}]}, "jsonl", r":3: messages\[0\] has unknown role None"),
    (
        "empty content",
        {"messages": [{"role": "user", "content": "  "}]},
        "jsonl",
        r":3: messages\[0\] has empty content",
    ),
    (
        "non-string content",
        {"messages": [{"role": "user", "content": 5}]},
        "jsonl",
        r":3: messages\[0\] content must be a string, got int",
    ),
    (
        "no user turn",
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        "jsonl",
        r":3: 'messages' has no user turn",
    ),
    ("bad id", {"id": [1], "messages": USER}, "jsonl", r":3: 'id' must be a string or an integer"),
    (
        "json list row",
        {"messages": [{"role": "bot", "content": "q"}]},
        "json",
        r":row 2: messages\[0\] has unknown role 'bot'",
    ),
    (
        "parquet row",
        {"messages": [{"role": "user", "content": ""}]},
        "parquet",
        r":row 2: messages\[0\] has empty content",
    ),
    (
        "datasets row",
        {"messages": [{"role": "assistant", "content": "a"}]},
        "datasets",
        r":row 2: 'messages' has no user turn",
    ),
]


def write_rows(tmp_path, kind, rows):
    if kind == "jsonl":
        return write_jsonl(tmp_path / "p.jsonl", rows)
    if kind == "json":
        (tmp_path / "p.json").write_text(json.dumps(rows))
        return tmp_path / "p.json"
    good = [
        {"messages": r.get("messages") or [{"role": "user", "content": r["conversations"][0]["value"]}]} for r in GOOD
    ]
    if kind == "parquet":
        return write_parquet(tmp_path / "p.parquet", good + rows[2:])
    return save_dataset(tmp_path / "ds", good + rows[2:])


@pytest.mark.parametrize("name,bad,kind,message", ROW_ERRORS, ids=[c[0] for c in ROW_ERRORS])
def test_bad_row_fails_with_file_and_line(tmp_path, name, bad, kind, message):
    path = write_rows(tmp_path, kind, GOOD + [bad])
    with pytest.raises(UsageError, match=message) as err:
        load_prompts(path)
    assert err.value.message.startswith(str(path) + ":")
    assert "data.on_bad_row: skip" in err.value.remedy
    assert err.value.exit_code == 2

    ps = load_prompts(path, on_bad_row="skip")
    assert len(ps.records) == 2 and ps.total_rows == 3
    (bad_row,) = ps.bad_rows
    assert bad_row.source == err.value.message.split(": ")[0]
    assert bad_row.reason and bad_row.reason in err.value.message


def _dataset_dict_without_train(path):
    import datasets

    datasets.DatasetDict(
        {"a": datasets.Dataset.from_list([OPENAI]), "b": datasets.Dataset.from_list([OPENAI])}
    ).save_to_disk(str(path))
    return path


def _write(path, data):
    path.write_bytes(data)
    return path


def _mkdir(path):
    path.mkdir()
    (path / "notes.txt").write_text("x")
    return path


# Problems with the file as a whole: they raise even with on_bad_row=skip.
FILE_ERRORS = [
    ("missing file", lambda d: d / "nope.jsonl", r"prompt data not found: .*nope\.jsonl"),
    ("empty file", lambda d: _write(d / "e.jsonl", b""), r"e\.jsonl: no rows"),
    ("blank lines only", lambda d: _write(d / "b.jsonl", b"\n  \n"), r"b\.jsonl: no rows"),
    ("empty json list", lambda d: _write(d / "l.json", b"[]"), r"l\.json: no rows"),
    (
        "broken json list",
        lambda d: _write(d / "l.json", b'[\n {"messages": []},\n {oops}\n]'),
        r"l\.json:3:3: not valid JSON",
    ),
    ("unknown extension", lambda d: _write(d / "p.txt", b"hi"), r"p\.txt: unknown prompt file type '\.txt'"),
    ("plain directory", lambda d: _mkdir(d / "folder"), r"folder: a directory that is not a datasets saved folder"),
    (
        "parquet without the column",
        lambda d: write_parquet(d / "t.parquet", [{"text": "hi"}]),
        r"t\.parquet: no 'conversations' or 'messages' column \(columns: text\)",
    ),
    (
        "unreadable parquet",
        lambda d: _write(d / "bad.parquet", b"PAR1 not really parquet"),
        r"bad\.parquet: not a readable Parquet",
    ),
    (
        "datasets folder without the column",
        lambda d: save_dataset(d / "ds", [{"text": "hi"}]),
        r"ds: no 'conversations' or 'messages' column",
    ),
    (
        "dataset dict without train",
        lambda d: _dataset_dict_without_train(d / "dd"),
        r"dd: a DatasetDict with splits \['a', 'b'\]",
    ),
]


@pytest.mark.parametrize("name,make,message", FILE_ERRORS, ids=[c[0] for c in FILE_ERRORS])
def test_bad_file_fails_naming_it(tmp_path, name, make, message):
    path = make(tmp_path)
    for on_bad_row in ("fail", "skip"):
        with pytest.raises(UsageError, match=message) as err:
            load_prompts(path, on_bad_row=on_bad_row)
        assert str(path) in err.value.message and err.value.remedy
    with pytest.raises(UsageError, match=message):
        peek_prompts(path)


# --- lines no prompt file should hold ------------------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000  # json.loads raised RecursionError on it


@pytest.mark.parametrize(
    "line, reason",
    [
        (DEEP, "JSON nested deeper than 100 levels"),
        (
            '{"messages": [{"role": "user", "content": "q", "meta": '
            + "{}" * 0
            + '{"a": ' * 150
            + "1"
            + "}" * 151
            + "]}",
            "JSON nested deeper than 100 levels",
        ),
        ('{"id": ' + "7" * 5000 + ', "messages": [{"role": "user", "content": "q"}]}', "unreadable JSON"),
        ('{"messages": [{"role": "user", "content": "half a pair \\ud800"}]}', "lone surrogate"),
        ('{"id": "\\udfff", "messages": [{"role": "user", "content": "q"}]}', "lone surrogate"),
    ],
    ids=["deep list", "deep metadata", "5000-digit id", "surrogate content", "surrogate id"],
)
def test_lines_past_the_parsers_limits_are_bad_rows_with_their_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "p.jsonl", [*GOOD, line, {"messages": [{"role": "user", "content": "after"}]}])
    with pytest.raises(UsageError) as err:
        load_prompts(path)
    assert err.value.message.startswith(f"{path}:3: ") and reason in err.value.message
    ps = load_prompts(path, on_bad_row="skip")
    assert [r.messages[0]["content"] for r in ps.records] == ["first", "second", "after"]
    assert [b.source for b in ps.bad_rows] == [f"{path}:3"]


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    text = "[{" * 300 + '"\\' + "}]" * 10  # an escaped quote and backslash inside the string, too
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": text}]}])
    assert load_prompts(path).records[0].messages[0]["content"] == text


def test_a_line_past_the_size_bound_is_a_bad_row_read_past(tmp_path):
    from eaglekit.data.prompts import MAX_LINE_BYTES

    huge = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_LINE_BYTES}]})
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], huge, GOOD[1]])
    with pytest.raises(UsageError, match=r"p\.jsonl:2: line longer than 16 MiB"):
        load_prompts(path)
    ps = load_prompts(path, on_bad_row="skip")
    assert [r.id for r in ps.records] == ["7", "8"] and ps.bad_rows[0].source == f"{path}:2"


def test_a_json_list_nested_too_deep_names_its_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[\n" + json.dumps(GOOD[0]) + ",\n" + DEEP + "\n]\n")
    with pytest.raises(UsageError, match=r"p\.json:3: JSON nested deeper than 100 levels"):
        load_prompts(path)

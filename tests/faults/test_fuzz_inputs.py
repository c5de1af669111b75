"""Fuzz: malformed run configs and prompt files, drawn by Hypothesis from a fixed seed and each run through the CLI in
this process. Whatever the input, the command ends with its documented exit code (2 for a bad config or a prompt file
the stage reads, 1 for a pre-flight that fails on it), one `error:` line naming the file, the key or the line, no
traceback anywhere, and nothing written outside the run directory.

The config cases come from the schema itself (every key of RunConfig, with a value its type or bounds refuse), so a
key added later is fuzzed too.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import types
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from annotated_types import Ge, Gt, Le, Lt, MinLen
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from support.helpers import write_config

from eaglekit.config import DTYPE_ALIASES, TTT_MOVED, RunConfig
from eaglekit.data.prompts import MAX_JSON_DEPTH, MAX_LINE_BYTES
from eaglekit.divergences import DIVERGENCES

CONFIG_EXAMPLES = 160
PROMPT_EXAMPLES = 90
FUZZ = settings(
    derandomize=True,  # the same examples on every run and machine: a failure reproduces
    deadline=None,
    database=None,  # nothing kept between runs: derandomize makes them the same anyway
    # the first failing example is reported as drawn: shrinking it reruns the CLI for minutes, and each is one class
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@pytest.fixture(autouse=True)
def hypothesis_home(tmp_path_factory):
    """Hypothesis keeps what it learns of the source in a folder (the cwd's .hypothesis): a temporary one here."""
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


# ------------------------------------------------------------------------------------------------ the schema's keys


@dataclass(frozen=True)
class Key:
    path: tuple[str, ...]
    kind: str  # int | float | bool | str | literal | list | dict | sections (a list of sections: evaluate.suites)
    # | tagged (one of several sections by name: train.ttt.loss)
    choices: tuple = ()
    low: float | None = None  # the bound a value must reach: ge (inclusive) or gt (exclusive)
    low_inclusive: bool = True
    high: float | None = None
    high_inclusive: bool = True
    item: Key | None = None  # a list's items
    min_length: int = 0


def _bounds(metadata: list) -> dict:
    out: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out |= _bounds(m.metadata)
        elif isinstance(m, Ge):
            out |= {"low": m.ge, "low_inclusive": True}
        elif isinstance(m, Gt):
            out |= {"low": m.gt, "low_inclusive": False}
        elif isinstance(m, Le):
            out |= {"high": m.le, "high_inclusive": True}
        elif isinstance(m, Lt):
            out |= {"high": m.lt, "high_inclusive": False}
        elif isinstance(m, MinLen):
            out["min_length"] = m.min_length
    return out


def _key(path: tuple[str, ...], annotation: Any, metadata: list) -> Key | None:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata = [*metadata, *extra]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) > 1:  # one of several sections, chosen by its name (train.ttt.loss)
            return Key(path, "tagged", choices=tuple(DIVERGENCES))
        return _key(path, inner[0], metadata)
    bounds = _bounds(metadata)
    if typing.get_origin(annotation) is typing.Literal:
        return Key(path, "literal", choices=typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return Key(path, "sections")
        return Key(path, "list", item=_key((*path, "0"), item, []), min_length=bounds.get("min_length", 0))
    if typing.get_origin(annotation) is dict:
        return Key(path, "dict")
    kind = {int: "int", float: "float", bool: "bool", str: "str"}.get(annotation)
    return None if kind is None else Key(path, kind, **bounds)


def schema_keys(model: type[BaseModel] = RunConfig, prefix: tuple[str, ...] = ()) -> list[Key]:
    keys: list[Key] = []
    for name, field in model.model_fields.items():
        if field.exclude:  # RunConfig.source: where the file was read from, not a key of it
            continue
        annotation = field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = inner[0] if len(inner) == 1 else annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += schema_keys(annotation, (*prefix, name))
        elif (key := _key((*prefix, name), field.annotation, list(field.metadata))) is not None:
            keys.append(key)
    return keys


KEYS = schema_keys()
SECTIONS = [n for n in RunConfig.model_fields if n not in ("run_dir", "source")]

# ------------------------------------------------------------------------------------------------ refused values

# Strings of letters only: never a number, and YAML quotes those it would read otherwise (yes, off, null).
words = st.text(alphabet=st.characters(categories=["L"]), min_size=1, max_size=12)
BOOL_WORDS = {"yes", "no", "on", "off", "true", "false", "t", "f", "y", "n"}
huge_ints = st.one_of(
    st.integers(min_value=2**63, max_value=2**200), st.integers(min_value=-(2**200), max_value=-(2**63) - 1)
)
beyond_floats = st.integers(min_value=2**1024, max_value=2**1100)  # an integer no float holds
fractions = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6).filter(
    lambda x: x != int(x)
)
containers = st.sampled_from([[1, 2], {"a": 1}, []])


def below(key: Key) -> st.SearchStrategy:
    assert key.low is not None
    if key.kind == "int":
        return st.integers(min_value=-(2**40), max_value=int(key.low) - (1 if key.low_inclusive else 0))
    top = key.low if not key.low_inclusive else key.low - 1e-9
    return st.floats(min_value=-1e12, max_value=top, allow_nan=False, allow_infinity=False)


def refused(key: Key) -> st.SearchStrategy:
    """Values the key must refuse: of another type, past its bounds, non-finite, past 64 bits."""
    if key.kind == "int":
        options = [huge_ints, words, fractions, containers]
        options += [below(key)] if key.low is not None else []
        if key.high is not None:
            options.append(st.integers(min_value=int(key.high) + key.high_inclusive, max_value=2**40))
    elif key.kind == "float":
        options = [st.sampled_from([float("inf"), float("-inf"), float("nan")]), beyond_floats, containers]
        options += [words.filter(lambda w: w.lower() not in ("inf", "nan", "infinity"))]
        options += [below(key)] if key.low is not None else []
        if key.high is not None:
            first = key.high + 1e-6 if key.high_inclusive else key.high
            options.append(st.floats(min_value=first, max_value=1e12, allow_nan=False))
    elif key.kind == "bool":
        options = [
            words.filter(lambda w: w.lower() not in BOOL_WORDS),
            st.integers(min_value=2, max_value=99),
            containers,
        ]
    elif key.kind == "str":
        options = [st.integers(), containers, st.floats(allow_nan=False, allow_infinity=False)]
        options += [st.just("")] if key.min_length else []  # a path that must name something
    elif key.kind == "literal":
        named = {str(c) for c in key.choices} | set(DTYPE_ALIASES)
        options = [words.filter(lambda w: w.strip().lower() not in named and w not in named), st.integers(), containers]
    elif key.kind == "list":
        assert key.item is not None
        options = [words, st.integers(), refused(key.item).map(lambda v: [v])]
        options += [st.just([])] if key.min_length else []
    elif key.kind == "dict":
        options = [words, st.integers(), st.just([1, 2])]
    elif key.kind == "tagged":
        unknown = words.filter(lambda w: w not in key.choices)
        options = [unknown, unknown.map(lambda w: {"name": w}), st.integers(), st.just([1, 2]), st.just({"name": 7})]
    else:  # a list of sections
        options = [st.just([{"name": 5}]), st.just([{"nmae": "gsm8k"}]), st.just([7]), st.just({"name": "gsm8k"})]
    return st.one_of(*options)


# ------------------------------------------------------------------------------------------------ config cases


def standin_target(root: Path) -> Path:
    """A folder shaped like a target (the config cases never get past loading the config)."""
    t = root / "target"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "vocab_size": 100}))
    return t


def base_config(root: Path, target: Path) -> dict:
    (root / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}]}) + "\n")
    return {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "prompts.jsonl"}}


def edited(config: dict, how: str, path: tuple[str, ...], value: Any) -> dict:
    node = config
    for part in path[:-1]:
        node = node.setdefault(part, {})
    if how == "drop":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


@st.composite
def config_cases(draw) -> tuple[str, Any, str]:
    """(input class, an edit of the base config (set or drop, the key, the value) or the file's whole text, what the
    error must name)."""
    kind = draw(
        st.sampled_from(
            ["refused value"] * 6
            + ["unknown key", "section not a mapping", "not a mapping", "bad YAML", "binary", "run_dir", "missing key"]
        )
    )
    if kind == "refused value":
        key_kind = draw(st.sampled_from(sorted({k.kind for k in KEYS})))  # each kind, however few keys it has
        key = draw(st.sampled_from([k for k in KEYS if k.kind == key_kind]))
        value = draw(refused(key))
        return key.kind, ("set", key.path, value), ".".join(key.path)
    if kind == "unknown key":
        section = draw(st.sampled_from([None, *SECTIONS]))
        model = RunConfig if section is None else RunConfig.model_fields[section].annotation
        moved = TTT_MOVED if section == "train" else {}  # an old spelling is a key still (train.noise)
        name = draw(words.filter(lambda w: w not in model.model_fields and w not in moved))  # type: ignore[union-attr]
        path = (name,) if section is None else (section, name)
        value = draw(st.integers())
        return kind, ("set", path, value), ".".join(path)
    if kind == "section not a mapping":
        section = draw(st.sampled_from(SECTIONS))
        value = draw(st.one_of(words, st.integers(), st.just([1, 2])))
        return kind, ("set", (section,), value), section
    if kind == "missing key":
        section = draw(st.sampled_from(["run_dir", "target", "data"]))
        return kind, ("drop", (section,), None), section
    if kind == "run_dir":
        value = draw(st.sampled_from(["", "   ", "taken", "taken/run", "taken/a/b"]))
        return kind, ("set", ("run_dir",), value), "run_dir"
    if kind == "not a mapping":
        text = draw(st.sampled_from(["", "- a\n- list\n", "just a string\n", "42\n", "null\n", "~\n", "[1, {a: 2}]\n"]))
        return kind, text, ""
    if kind == "bad YAML":
        text = draw(
            st.sampled_from(
                [
                    "run_dir: run\ntarget: {model: [\n",
                    "run_dir: run\n\ttarget: x\n",
                    "a: b: c\n",
                    "run_dir: !!python/object:os.system ls\n",
                    "key: 'unclosed\n",
                    "- [" * 5000 + "\n",
                    "run_dir: " + "[" * 20000 + "]" * 20000 + "\n",
                    "train: {seed: " + "9" * 5000 + "}\n",
                    "&a [*a]\n",
                ]
            )
        )
        return kind, text, ""
    return kind, draw(st.binary(min_size=1, max_size=300)), ""


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file() and skip not in p.parents
    }


def temp_logs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("eaglekit-*")}


def check_outcome(r, code: int, names: list[str], root: Path, before: dict, logs_before: set[str]) -> None:
    text = r.out + r.err
    assert r.code == code, text
    assert "Traceback" not in text, text
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.err
    for name in names:
        assert name in r.err, f"{name!r} not named in:\n{r.err}"
    assert snapshot(root, root / "run") == before, "a file outside the run directory was written or changed"
    assert temp_logs() == logs_before, "a log went to the temp folder, outside the run directory"


def test_malformed_configs_are_named_errors(tmp_path, cli):
    drawn: Counter[str] = Counter()
    target = standin_target(tmp_path)

    @settings(FUZZ, max_examples=CONFIG_EXAMPLES)
    @given(case=config_cases(), command=st.sampled_from(["preflight", "plan", "generate", "run", "status", "train"]))
    def one(case, command):
        kind, change, named = case
        drawn[kind] += 1
        root = Path(tempfile.mkdtemp(dir=tmp_path))
        try:
            config = root / "c.yaml"
            if isinstance(change, tuple):
                (root / "taken").write_text("a file where run_dir wants a folder")
                write_config(config, edited(base_config(root, target), *change))
            elif isinstance(change, bytes):
                config.write_bytes(change)
            else:
                config.write_text(change)
            before, logs = snapshot(root, root / "run"), temp_logs()
            r = cli(command, config)
            check_outcome(r, 2, [str(config), *([named] if named else [])], root, before, logs)
        finally:
            shutil.rmtree(root)

    one()
    assert sum(drawn.values()) >= CONFIG_EXAMPLES
    every = {"int", "float", "bool", "str", "literal", "list", "dict", "sections", "unknown key"}
    every |= {"section not a mapping", "not a mapping", "bad YAML", "binary", "run_dir", "missing key"}
    assert every <= set(drawn), f"input classes never drawn: {every - set(drawn)}"


# ------------------------------------------------------------------------------------------------ prompt files

GOOD_ROW = {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def good_rows(n: int) -> list[dict]:
    return [{"id": f"g{i}", **GOOD_ROW} for i in range(n)]


bad_rows = st.one_of(
    st.tuples(st.just("not JSON"), words.map(lambda w: "{" + w)),
    st.tuples(
        st.just("not an object"), st.one_of(st.integers(), words, st.just([1, 2]), st.just(None)).map(json.dumps)
    ),
    st.tuples(
        st.just("wrong field type"),
        st.sampled_from(
            [
                {"messages": "hello"},
                {"messages": []},
                {"messages": [5]},
                {"messages": [{"role": 5, "content": "q"}]},
                {"messages": [{"role": "wizard", "content": "q"}]},
                {"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user", "content": None}]},
                {"messages": [{"role": "user", "content": "   "}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
                {"conversations": [{"from": "gpt", "value": "only a reply"}]},
                {"id": 1.5, **GOOD_ROW},
                {"id": True, **GOOD_ROW},
                {"id": ["a"], **GOOD_ROW},
                {"prompt": "no conversation field"},
            ]
        ).map(json.dumps),
    ),
    st.tuples(st.just("surrogate"), st.just('{"messages": [{"role": "user", "content": "\\udc00"}]}')),
    st.tuples(
        st.just("deep nesting"),
        st.integers(min_value=MAX_JSON_DEPTH + 1, max_value=20_000).map(lambda d: "[" * d + "]" * d),
    ),
    st.tuples(
        st.just("huge number"), st.integers(min_value=4301, max_value=6000).map(lambda n: '{"id": ' + "9" * n + "}")
    ),
)


@st.composite
def prompt_cases(draw) -> tuple[str, str, bytes, list[str], bool]:
    """(input class, file name, its bytes, what the error must name, whether the stage's own read refuses it too)."""
    kind = draw(
        st.sampled_from(
            ["bad row"] * 5 + ["bad row in a list", "empty", "binary", "huge line", "suffix", "past context"]
        )
    )
    if kind == "bad row":
        bad_kind, line = draw(bad_rows)
        good = good_rows(draw(st.integers(min_value=0, max_value=4)))
        at = draw(st.integers(min_value=0, max_value=len(good)))
        lines = [json.dumps(r) for r in good]
        lines.insert(at, line)
        if at == 0 and line.startswith("["):  # a first line opening with [ makes the file one JSON list (p.json)
            lines.insert(0, json.dumps({"id": "first", **GOOD_ROW}))
            at = 1
        return bad_kind, "p.jsonl", "".join(x + "\n" for x in lines).encode(), [f"p.jsonl:{at + 1}"], True
    if kind == "bad row in a list":
        _, line = draw(bad_rows.filter(lambda b: b[0] not in ("not JSON", "deep nesting", "huge number")))
        good = [json.dumps(r) for r in good_rows(draw(st.integers(min_value=0, max_value=3)))]
        return kind, "p.json", ("[" + ",\n".join([*good, line]) + "]").encode(), [f"p.json:row {len(good)}"], True
    if kind == "empty":
        text = draw(st.sampled_from(["", "\n\n", "   \n\t\n"]))
        return kind, "p.jsonl", text.encode(), ["p.jsonl: no rows"], True
    if kind == "binary":
        data = draw(st.binary(min_size=1, max_size=2000))
        return kind, "p.jsonl", data, ["p.jsonl"], True
    if kind == "huge line":
        good = good_rows(draw(st.integers(min_value=0, max_value=2)))
        huge = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_LINE_BYTES}]})
        lines = [*map(json.dumps, good), huge]
        return kind, "p.jsonl", "".join(x + "\n" for x in lines).encode(), [f"p.jsonl:{len(lines)}: line longer"], True
    if kind == "suffix":
        name = "p" + draw(st.sampled_from([".txt", ".csv", ".yaml", ""]))
        return kind, name, (json.dumps(GOOD_ROW) + "\n").encode(), ["unknown prompt file type"], True
    # every prompt longer than prepare.max_length (64 in these configs): refused before generate starts
    words_per_prompt = draw(st.lists(st.integers(min_value=40, max_value=300), min_size=1, max_size=5, unique=True))
    rows = [
        {"id": f"long{i}", "messages": [{"role": "user", "content": "two plus two " * n}]}
        for i, n in enumerate(words_per_prompt)
    ]
    n = len(rows)
    return (
        kind,
        "p.jsonl",
        "".join(json.dumps(r) + "\n" for r in rows).encode(),
        [f"{n} of {n} prompts have more tokens than 64"],
        False,
    )


def test_malformed_prompt_files_are_named_errors(tmp_path, cli, tiny_target):
    drawn: Counter[str] = Counter()
    target_files = snapshot(tiny_target, tiny_target / "none")

    @settings(FUZZ, max_examples=PROMPT_EXAMPLES)
    @given(case=prompt_cases(), skip_preflight=st.booleans())
    def one(case, skip_preflight):
        kind, name, data, names, stage_refuses = case
        skip_preflight = skip_preflight and stage_refuses  # a stage that would start generating is never started
        drawn[kind] += 1
        root = Path(tempfile.mkdtemp(dir=tmp_path))
        try:
            (root / name).write_bytes(data)
            config = write_config(
                root / "c.yaml",
                {
                    "run_dir": "run",
                    "target": {"model": str(tiny_target)},
                    "data": {"prompts": name, "on_bad_row": "fail"},
                    "prepare": {"max_length": 64},
                    "preflight": {"disk_probe_mb": 0},
                },
            )
            before, logs = snapshot(root, root / "run"), temp_logs()
            r = cli("generate", config, *(["--skip-preflight"] if skip_preflight else []))
            # pre-flight names the problem in a failed check (exit 1); the stage's own read of the file, exit 2
            check_outcome(r, 2 if skip_preflight else 1, [str(root / name), *names], root, before, logs)
            assert not (root / "run" / "generate" / "responses.jsonl").exists()
        finally:
            shutil.rmtree(root)

    one()
    assert sum(drawn.values()) >= PROMPT_EXAMPLES
    every = {"not JSON", "not an object", "wrong field type", "surrogate", "deep nesting", "huge number"}
    every |= {"bad row in a list", "empty", "binary", "huge line", "suffix", "past context"}
    assert every <= set(drawn), f"input classes never drawn: {every - set(drawn)}"
    assert snapshot(tiny_target, tiny_target / "none") == target_files, "the target folder was written"

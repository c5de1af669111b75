"""Table-driven: malformed configs, prompt datasets and target folders each give a clear error naming the
file, line or field — exit 2 for usage/config errors, exit 1 for a failed pre-flight check — never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.helpers import write_config

GOOD_PROMPT = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}]}


def make_target(root: Path, drop: str | None = None, index_missing_shard: bool = False, bad_json: bool = False) -> Path:
    """A folder with the files a target needs (contents are stand-ins: pre-flight checks presence and shape)."""
    t = root / "target"
    t.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps({"num_hidden_layers": 8, "vocab_size": 100}),
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "model.safetensors": "x",
    }
    if bad_json:
        files["config.json"] = "{not json"
    if index_missing_shard:
        del files["model.safetensors"]
        files["model.safetensors.index.json"] = json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
        files["model-00001-of-00002.safetensors"] = "x"
    for name, text in files.items():
        if drop is None or not name.startswith(drop):
            (t / name).write_text(text)
    return t


def base(root: Path, **over) -> dict:
    (root / "prompts.jsonl").write_text(json.dumps(GOOD_PROMPT) + "\n")
    cfg = {"run_dir": "run", "target": {"model": str(make_target(root))}, "data": {"prompts": "prompts.jsonl"}}
    for k, v in over.items():
        cfg[k] = v
    return cfg


def prompts_lines(root: Path, lines: list[str]) -> dict:
    cfg = base(root)
    (root / "bad.jsonl").write_text("".join(line + "\n" for line in lines))
    cfg["data"] = {"prompts": "bad.jsonl"}
    return cfg


OK = json.dumps(GOOD_PROMPT)

# (case id, build config dict under root -> dict | str (raw YAML), CLI args after the config, exit code, must-mention)
CASES = [
    ("unknown top-level key", lambda r: {**base(r), "trian": {}}, ["prepare"], 2, ["'trian'"]),
    ("unknown nested key", lambda r: {**base(r), "generate": {"max_token": 3}}, ["prepare"], 2, ["generate.max_token"]),
    ("wrong type", lambda r: {**base(r), "train": {"lr": "fast"}}, ["prepare"], 2, ["train.lr"]),
    ("bad enum", lambda r: {**base(r), "generate": {"reasoning": "maybe"}}, ["prepare"], 2, ["generate.reasoning"]),
    ("negative count", lambda r: {**base(r), "generate": {"max_tokens": -1}}, ["prepare"], 2, ["generate.max_tokens"]),
    ("missing section", lambda r: {k: v for k, v in base(r).items() if k != "data"}, ["prepare"], 2, ["'data'"]),
    ("not a mapping", lambda r: "- just\n- a list\n", ["prepare"], 2, ["YAML mapping"]),
    ("invalid YAML", lambda r: "run_dir: run\ntarget: {model: [\n", ["prepare"], 2, ["c.yaml:", "not valid YAML"]),
    (
        "openai without servers",
        lambda r: {**base(r), "generate": {"backend": "openai", "model": "m"}},
        ["prepare"],
        2,
        ["generate.servers"],
    ),
    ("unknown --from stage", lambda r: base(r), ["run", "--from", "trainn"], 2, ["trainn"]),
    ("unknown export format", lambda r: base(r), ["export", "--format", "gguf"], 2, ["gguf"]),
    ("unknown preflight stage", lambda r: base(r), ["preflight", "--stage", "bake"], 2, ["bake"]),
    (
        "target folder missing",
        lambda r: {**base(r), "target": {"model": str(r / "nowhere")}},
        ["preflight", "--stage", "prepare"],
        1,
        ["nowhere", "does not exist"],
    ),
    (
        "target without config.json",
        lambda r: {**base(r), "target": {"model": str(make_target(r / "x", drop="config.json"))}},
        ["preflight", "--stage", "prepare"],
        1,
        ["config.json"],
    ),
    (
        "target without tokenizer",
        lambda r: {**base(r), "target": {"model": str(make_target(r / "x", drop="tokenizer"))}},
        ["preflight", "--stage", "prepare"],
        1,
        ["tokenizer files"],
    ),
    (
        "target without weights",
        lambda r: {**base(r), "target": {"model": str(make_target(r / "x", drop="model"))}},
        ["preflight", "--stage", "prepare"],
        1,
        ["weights"],
    ),
    (
        "target missing a shard",
        lambda r: {**base(r), "target": {"model": str(make_target(r / "x", index_missing_shard=True))}},
        ["preflight", "--stage", "prepare"],
        1,
        ["model-00002-of-00002.safetensors"],
    ),
    (
        "target config not JSON",
        lambda r: {**base(r), "target": {"model": str(make_target(r / "x", bad_json=True))}},
        ["preflight", "--stage", "prepare"],
        1,
        ["config.json", "not valid JSON"],
    ),
    (
        "draft vocab larger than target's",
        lambda r: {**base(r), "vocab": {"draft_vocab_size": 1000}},
        ["preflight", "--stage", "vocab"],
        1,
        ["1000", "exceeds"],
    ),
    (
        "prompts file missing",
        lambda r: {**base(r), "data": {"prompts": "nope.jsonl"}},
        ["preflight", "--stage", "generate"],
        1,
        ["nope.jsonl"],
    ),
    (
        "prompts bad JSON on line 3",
        lambda r: prompts_lines(r, [OK, OK, "{oops", OK]),
        ["preflight", "--stage", "generate"],
        1,
        ["bad.jsonl:3"],
    ),
    (
        "prompts row not an object",
        lambda r: prompts_lines(r, [OK, "[1, 2]"]),
        ["preflight", "--stage", "generate"],
        1,
        ["bad.jsonl:2"],
    ),
    (
        "prompts without user turn",
        lambda r: prompts_lines(r, [json.dumps({"messages": [{"role": "system", "content": "hi"}]})]),
        ["preflight", "--stage", "generate"],
        1,
        ["bad.jsonl:1"],
    ),
    (
        "prompts unknown role",
        lambda r: prompts_lines(r, [json.dumps({"conversations": [{"from": "alien", "value": "hi"}]})]),
        ["preflight", "--stage", "generate"],
        1,
        ["bad.jsonl:1", "alien"],
    ),
    ("prompts empty file", lambda r: prompts_lines(r, []), ["preflight", "--stage", "generate"], 1, ["bad.jsonl"]),
    ("status of a folder that is no run", lambda r: base(r), ["status-of-tmp"], 2, ["config.yaml"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_gives_a_clear_error(tmp_path, cli, case):
    _, build, args, code, mentions = case
    data = build(tmp_path)
    cfg_path = tmp_path / "c.yaml"
    if isinstance(data, str):
        cfg_path.write_text(data)
    else:
        write_config(cfg_path, data)
    if args == ["status-of-tmp"]:
        (tmp_path / "empty").mkdir()
        r = cli("status", tmp_path / "empty")
    else:
        r = cli(args[0], cfg_path, *args[1:], *(["--json"] if args[0] == "preflight" else []))
    text = r.out + r.err
    assert r.code == code, text
    assert "Traceback" not in text
    for m in mentions:
        assert m in text, f"{m!r} not in output:\n{text}"
    if args[0] == "preflight" and code == 1:
        doc = json.loads(r.out)
        failed = [c for checks in doc["stages"].values() for c in checks if c["status"] == "fail"]
        assert failed and all(c["remedy"] for c in failed), "every failed check says what to do"
    else:
        assert "what to do" in r.err or "Usage" in r.err or "Error" in r.err


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20


def tiny_copy(tiny_target: Path, root: Path, **config_changes) -> Path:
    """A copy of the real tiny target whose config.json carries ``config_changes``."""
    import shutil

    target = root / "target-copy"
    shutil.copytree(tiny_target, target)
    doc = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**doc, **config_changes}))
    return target


def test_a_check_that_crashes_is_one_failed_line_naming_check_and_input(tmp_path, cli, tiny_target):
    # a target config.json with no attention heads: the drafter's shape check divides by them
    target = tiny_copy(tiny_target, tmp_path, num_attention_heads=0)
    (tmp_path / "prompts.jsonl").write_text(OK + "\n")
    cfg = {"run_dir": "run", "target": {"model": str(target)}, "data": {"prompts": "prompts.jsonl"}}
    config = write_config(tmp_path / "c.yaml", cfg)
    r = cli("preflight", config, "--stage", "train", "--json")
    assert r.code == 1 and "Traceback" not in r.out + r.err
    (crashed,) = [c for c in json.loads(r.out)["stages"]["train"] if c["name"] == "drafter_shape"]
    assert crashed["status"] == "fail"
    assert crashed["detail"] == (
        f"check drafter_shape could not run on {config} (stage train): ZeroDivisionError: integer modulo by zero"
    )
    log = Path(crashed["remedy"].rsplit(" ", 1)[-1])
    assert log.parent == tmp_path / "run" / "logs" and "ZeroDivisionError" in log.read_text()
    r = cli("train", config)  # the stage refuses with the same line, not a traceback
    assert r.code == 1 and "Traceback" not in r.out + r.err
    assert "drafter_shape: check drafter_shape could not run on" in r.err


def test_a_check_keeps_the_message_of_an_error_it_foresaw(tmp_path):
    from eaglekit import pipeline, preflight
    from eaglekit.config import parse_config
    from eaglekit.errors import UsageError

    cfg = parse_config(base(tmp_path), source="c.yaml", base_dir=tmp_path)
    ctx = pipeline.make_context(cfg, "prepare")

    def foreseen(ctx):
        raise UsageError("prompts.jsonl:3: no user turn", "fix that row")

    def unforeseen(ctx):
        raise KeyError("max_position_embeddings")

    first, second = preflight.run_checks(ctx, [foreseen, unforeseen])
    assert (first.status, first.detail, first.remedy) == ("fail", "prompts.jsonl:3: no user turn", "fix that row")
    assert second.status == "fail" and second.detail == (
        "check unforeseen could not run on the run config (stage prepare): KeyError: 'max_position_embeddings'"
    )
    assert "report it" in second.remedy


def long_prompts_config(root: Path, tiny_target: Path, lengths: list[int]) -> Path:
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": "two plus two " * n}]} for i, n in enumerate(lengths)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run_dir": "run",
        "target": {"model": str(tiny_target)},
        "data": {"prompts": "prompts.jsonl"},
        "preflight": {"disk_probe_mb": 0},
    }
    return write_config(root / "c.yaml", cfg)


def test_prompts_past_the_targets_context_are_counted_before_generate(tmp_path, cli, tiny_target):
    # the tiny target's max_position_embeddings is 1024, below prepare.max_length's 2048
    config = long_prompts_config(tmp_path, tiny_target, [1, 400, 2, 500])
    r = cli("preflight", config, "--stage", "generate", "--json")
    (check,) = [c for c in json.loads(r.out)["stages"]["generate"] if c["name"] == "prompt length"]
    assert r.code == 0 and check["status"] == "warn", check
    assert check["detail"].startswith(
        f"{tmp_path / 'prompts.jsonl'}: 2 of 4 prompts have more tokens than 1,024 (the target's max_position_embeddings"
    )
    assert "e.g. 'p3' with" in check["detail"] and check["remedy"]


def test_all_prompts_past_the_context_fail_generate_before_it_starts(tmp_path, cli, tiny_target):
    config = long_prompts_config(tmp_path, tiny_target, [400, 500])
    r = cli("generate", config)
    assert r.code == 1 and "Traceback" not in r.out + r.err
    assert f"prompt length: {tmp_path / 'prompts.jsonl'}: 2 of 2 prompts have more tokens than 1,024" in r.err
    assert not (tmp_path / "run" / "generate" / "responses.jsonl").exists()


def test_the_prompt_bound_is_prepare_max_length_when_smaller(tmp_path, cli, tiny_target):
    config = long_prompts_config(tmp_path, tiny_target, [1, 30])
    data = yaml.safe_load(config.read_text())
    write_config(config, {**data, "prepare": {"max_length": 64}})
    r = cli("preflight", config, "--stage", "generate", "--json")
    (check,) = [c for c in json.loads(r.out)["stages"]["generate"] if c["name"] == "prompt length"]
    assert (
        check["status"] == "warn"
        and "1 of 2 prompts have more tokens than 64 (prepare.max_length 64)" in check["detail"]
    )
    assert "raise prepare.max_length" in check["remedy"]


def test_served_long_the_prompt_bound_names_raising_max_length_first(tmp_path, cli, tiny_target):
    # long rows are what keeps a drafter's acceptance at long context: dropping them is not the first remedy then
    config = long_prompts_config(tmp_path, tiny_target, [1, 30])
    data = yaml.safe_load(config.read_text())
    write_config(config, {**data, "prepare": {"max_length": 64}, "evaluate": {"context_lengths": [16384]}})
    r = cli("preflight", config, "--stage", "generate", "--json")
    (check,) = [c for c in json.loads(r.out)["stages"]["generate"] if c["name"] == "prompt length"]
    assert check["status"] == "warn" and "1 of 2 prompts" in check["detail"]
    assert check["remedy"].startswith("raise prepare.max_length (to 1,024: the longest prompt and generate.max_tokens)")
    assert "served at up to 16,384 (evaluate.context_lengths)" in check["remedy"]


def test_a_prompt_the_chat_template_refuses_is_named_by_its_line(tmp_path, cli, tiny_target):
    template = (tiny_target / "chat_template.jinja").read_text()
    guard = "{%- if messages | selectattr('role', 'equalto', 'system') | list | length > 1 %}"
    (tmp_path / "t.jinja").write_text(guard + "{{ raise_exception('one system turn at most') }}{%- endif %}" + template)
    config = long_prompts_config(tmp_path, tiny_target, [1])
    two_systems = [
        {"role": "system", "content": "s1"},
        {"role": "system", "content": "s2"},
        {"role": "user", "content": "q"},
    ]
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write(json.dumps({"id": "two systems", "messages": two_systems}) + "\n")
    write_config(
        config,
        {**yaml.safe_load(config.read_text()), "target": {"model": str(tiny_target), "chat_template": "t.jinja"}},
    )
    r = cli("preflight", config, "--stage", "generate", "--json")
    (check,) = [c for c in json.loads(r.out)["stages"]["generate"] if c["name"] == "prompt_length"]
    assert r.code == 1 and check["status"] == "fail"
    assert (
        check["detail"]
        == f"{tmp_path / 'prompts.jsonl'}:2: the target's chat template refuses this prompt (one system turn at most)"
    )

"""The run config: unknown keys, wrong types and missing files are usage errors (exit 2) naming the key or path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import write_config

from eaglekit.config import load_config, parse_config
from eaglekit.errors import UsageError

BASE = {"run_dir": "run", "target": {"model": "model"}, "data": {"prompts": "prompts.jsonl"}}


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    cfg = load_config(write_config(tmp_path / "sub" / "c.yaml", BASE))
    assert Path(cfg.run_dir) == tmp_path / "sub" / "run"
    assert Path(cfg.data.prompts) == tmp_path / "sub" / "prompts.jsonl"
    assert Path(cfg.target.model) == tmp_path / "sub" / "model"


def test_a_hub_id_stays_a_hub_id(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", {**BASE, "target": {"model": "moonshotai/Kimi-K2"}}))
    assert cfg.target.model == "moonshotai/Kimi-K2"


def test_defaults_follow_the_interface(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    assert cfg.generate.backend == "local"
    assert cfg.target.trust_remote_code is False
    assert cfg.train.ttt_steps == 7 and cfg.train.ttt_decay == 0.8
    assert cfg.stages() == ["generate", "prepare", "vocab", "train", "evaluate", "export"]
    cfg.extract.mode = "offline"
    assert "extract" in cfg.stages()


@pytest.mark.parametrize(
    "data, key",
    [
        ({**BASE, "generate": {"max_token": 5}}, "generate.max_token"),
        ({**BASE, "colour": "blue"}, "colour"),
        ({**BASE, "generate": {"max_tokens": "lots"}}, "generate.max_tokens"),
        ({"run_dir": "r", "data": {"prompts": "p"}}, "target"),
    ],
)
def test_bad_keys_are_named(tmp_path, data, key):
    with pytest.raises(UsageError) as e:
        load_config(write_config(tmp_path / "c.yaml", data))
    assert f"'{key}'" in e.value.message
    assert str(tmp_path / "c.yaml") in e.value.message


def test_cli_config_errors_exit_2_naming_key_or_path(tmp_path, cli):
    r = cli("prepare", tmp_path / "missing.yaml")
    assert r.code == 2 and "missing.yaml" in r.err
    bad = write_config(tmp_path / "c.yaml", {**BASE, "prepare": {"max_lenght": 9}})
    r = cli("prepare", bad)
    assert r.code == 2 and "prepare.max_lenght" in r.err and "Traceback" not in r.err


def test_yaml_booleans_of_an_on_off_choice_are_accepted_and_elsewhere_explained():
    base = "run_dir: r\ntarget: {model: m}\ndata: {prompts: p}\n"
    assert parse_config(yaml.safe_load(base + "generate: {reasoning: off}\n")).generate.reasoning == "off"
    assert parse_config(yaml.safe_load(base + "generate: {reasoning: on}\n")).generate.reasoning == "required"
    with pytest.raises(UsageError) as err:
        parse_config(yaml.safe_load(base + "extract: {mode: no}\n"))
    assert "'extract.mode'" in err.value.message and 'quote the value, e.g. "off"' in err.value.message


def test_verify_runs_only_when_an_engine_or_a_server_is_set(tmp_path):
    base = {"run_dir": "run", "target": {"model": "org/m"}, "data": {"prompts": "p.jsonl"}}
    assert "verify" not in parse_config(base, base_dir=tmp_path).stages()
    assert parse_config({**base, "verify": {"engine": "vllm"}}, base_dir=tmp_path).stages()[-2:] == ["export", "verify"]
    assert parse_config({**base, "verify": {"server": "http://h:8000/v1"}}, base_dir=tmp_path).stages()[-1] == "verify"
    with pytest.raises(UsageError, match="verify.engine and verify.server"):
        parse_config({**base, "verify": {"engine": "vllm", "server": "http://h:8000"}}, base_dir=tmp_path)
    with pytest.raises(UsageError, match="verify.engine"):
        parse_config({**base, "verify": {"engine": "sglang"}}, base_dir=tmp_path)


@pytest.mark.parametrize(
    "typed, stored",
    [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16"),
     ("half", "float16"), ("fp32", "float32"), ("float", "float32"), ("bfloat16", "bfloat16")],
)  # fmt: skip
def test_dtype_aliases_are_accepted_and_normalised(tmp_path, typed, stored):
    base = {"run_dir": "runs/x", "target": {"model": "m"}, "data": {"prompts": "p.jsonl"}}
    cfg = parse_config(
        {**base, "target": {"model": "m", "dtype": typed}, "train": {"dtype": typed if stored != "float16" else "fp32"},
         "extract": {"dtype": typed}},
        base_dir=tmp_path,
    )  # fmt: skip
    assert cfg.target.dtype == stored and cfg.extract.dtype == stored
    assert cfg.to_yaml().count(f"dtype: {stored}") >= 2  # the normalised name is what a saved config holds


def test_an_unknown_dtype_names_the_key_and_the_choices(tmp_path):
    with pytest.raises(UsageError) as err:
        parse_config({"run_dir": "r", "target": {"model": "m"}, "data": {"prompts": "p"}, "extract": {"dtype": "int4"}})
    assert "extract.dtype" in str(err.value) and "fp8" in str(err.value)

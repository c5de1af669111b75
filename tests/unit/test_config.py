"""The run config: unknown keys, wrong types and missing files are usage errors (exit 2) naming the key or path."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import Field
from support.helpers import write_config

from eaglekit import pipeline
from eaglekit.config import (
    DRAFT_KEYS,
    DRAFT_MODELS,
    TTT_MOVED,
    ConfigDeprecation,
    ConfigPath,
    DFlashDraft,
    DraftSection,
    DSparkDraft,
    GenerateConfig,
    LlamaDraft,
    MlaDraft,
    RunConfig,
    Section,
    ServerPoolConfig,
    TTTConfig,
    VllmFeaturesConfig,
    every_draft_key,
    load_config,
    parse_config,
)
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
    assert cfg.train.ttt.steps == 7 and cfg.train.ttt.decay == 0.8
    assert pipeline.stages_for(cfg) == ["generate", "prepare", "vocab", "train", "evaluate", "export"]
    cfg.extract.mode = "offline"
    assert "extract" in pipeline.stages_for(cfg)


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
    assert "verify" not in pipeline.stages_for(parse_config(base, base_dir=tmp_path))
    assert pipeline.stages_for(parse_config({**base, "verify": {"engine": "vllm"}}, base_dir=tmp_path))[-2:] == [
        "export",
        "verify",
    ]
    assert (
        pipeline.stages_for(parse_config({**base, "verify": {"server": "http://h:8000/v1"}}, base_dir=tmp_path))[-1]
        == "verify"
    )
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


POOL_KEYS = {"servers", "model", "api_key_env", "concurrency", "timeout", "max_retries", "retry_backoff",
             "probe_interval", "outage_timeout"}  # fmt: skip


def test_both_server_pools_share_one_definition_and_keep_their_own_defaults(tmp_path):
    assert set(ServerPoolConfig.model_fields) == POOL_KEYS
    assert issubclass(GenerateConfig, ServerPoolConfig) and issubclass(VllmFeaturesConfig, ServerPoolConfig)
    pool = {"servers": ["http://h:8000/v1"], "model": "m", "max_retries": 2, "outage_timeout": 30}
    cfg = parse_config(
        {**BASE, "generate": {"backend": "openai", **pool},
         "extract": {"mode": "offline", "backend": "vllm", "vllm": {**pool, "storage_path": "hs"}}},
        base_dir=tmp_path,
    )  # fmt: skip
    for section in (cfg.generate, cfg.extract.vllm):
        assert section is not None
        assert (section.max_retries, section.outage_timeout, section.probe_interval) == (2, 30, 30.0)
    assert (cfg.generate.concurrency, cfg.extract.vllm.concurrency) == (16, 8)  # each workload's default
    with pytest.raises(UsageError, match="'extract.vllm.concurrency'"):  # the shared constraints hold in both
        parse_config({**BASE, "extract": {"vllm": {"storage_path": "hs", "concurrency": 0}}}, base_dir=tmp_path)


def test_every_path_key_resolves_and_hub_ids_and_inline_templates_stay(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local-drafter").mkdir()  # a folder that looks like a hub id is the folder
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    cfg = parse_config(
        {"run_dir": "run", "target": {"model": "org/Hub-Model", "chat_template": template},
         "data": {"prompts": "p.jsonl"}, "train": {"init_from": "org/local-drafter"},
         "evaluate": {"prompts": "eval.jsonl", "checkpoint": "ckpt"}, "verify": {"python": "venv/bin/python"},
         "extract": {"mode": "offline", "backend": "vllm", "vllm": {"servers": ["http://h/v1"], "storage_path": "hs"}}},
        base_dir=tmp_path,
    )  # fmt: skip
    assert cfg.target.model == "org/Hub-Model" and cfg.target.chat_template == template
    assert cfg.train.init_from == str(tmp_path / "org" / "local-drafter")
    assert cfg.extract.vllm is not None and cfg.extract.vllm.storage_path == str(tmp_path / "hs")
    resolved = (cfg.run_dir, cfg.data.prompts, cfg.evaluate.prompts, cfg.evaluate.checkpoint, cfg.verify.python)
    assert resolved == tuple(str(tmp_path / p) for p in ("run", "p.jsonl", "eval.jsonl", "ckpt", "venv/bin/python"))
    on_disk = parse_config({**BASE, "target": {"model": "m", "chat_template": "t.jinja"}}, base_dir=tmp_path)
    assert on_disk.target.chat_template == str(tmp_path / "t.jinja")


def test_the_path_keys_are_the_schema_s_and_nothing_else_is_touched(tmp_path):
    marked = {
        f"{section}.{name}" if section else name
        for section, model in [("", RunConfig), *((s, f.annotation) for s, f in RunConfig.model_fields.items())]
        if isinstance(model, type) and issubclass(model, Section)
        for name, field in model.model_fields.items()
        if any(isinstance(m, ConfigPath) for m in field.metadata)
    }
    assert {"run_dir", "target.model", "target.chat_template", "data.prompts", "train.init_from",
            "evaluate.prompts", "evaluate.checkpoint", "verify.python"} <= marked  # fmt: skip
    cfg = parse_config({**BASE, "generate": {"model": "served/id"}, "export": {"verifier": "org/m"}}, base_dir=tmp_path)
    assert (cfg.generate.model, cfg.export.verifier) == ("served/id", "org/m")  # ids, not paths


def readers(key: str) -> str:
    """The families that read a train.draft key, as a refusal names them (a family added later reads some too)."""
    return ", ".join(name for name, model in DRAFT_MODELS.items() if key in model.model_fields)


@pytest.mark.parametrize(
    ("train", "named"),
    [
        ({"draft": {"architecture": "dflash"}, "ttt": {"loss": "jsd"}}, "loss: EAGLE-3's training-time-test settings"),
        (
            {"draft": {"architecture": "dspark"}, "ttt": {"anchor_weight": 5.0, "noise": "uniform"}},
            "noise, anchor_weight",
        ),
        ({"draft": {"architecture": "dflash"}, "ttt": {"activation_checkpointing": True}}, "activation_checkpointing"),
        ({"draft": {"architecture": "dflash"}, "ttt": {"loss": {"name": "lk_hybrid", "eta": 1.0}}}, "train.ttt's loss"),
        # the old flat spellings: moved under train.ttt, then refused alike
        ({"draft": {"architecture": "dflash"}, "loss": "jsd"}, "loss: EAGLE-3's training-time-test settings"),
        ({"draft": {"architecture": "dspark"}, "anchor_weight": 5.0, "noise": "uniform"}, "noise, anchor_weight"),
        ({"draft": {"block_size": 8}}, f"architecture llama does not read block_size ({readers('block_size')})"),
        ({"draft": {"architecture": "mla", "head_dim": 64}}, "architecture mla does not read head_dim"),
        (
            {"draft": {"architecture": "dflash", "markov_rank": 64}},
            f"does not read markov_rank ({readers('markov_rank')})",
        ),
        ({"draft": {"architecture": "dflash", "fc_norm": True}}, "architecture dflash does not read fc_norm"),
        ({"draft": {"architecture": "dflash", "hidden_size": 128}}, "architecture dflash does not read hidden_size"),
    ],
)
def test_a_key_the_drafter_family_does_not_read_is_refused_when_the_config_loads(train, named):
    """Silently ignored before: a block drafter's objective reads none of TTT's settings, and each family reads only
    its own train.draft keys."""
    from eaglekit.config import parse_config

    data = {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}, "train": train}
    with pytest.raises(Exception) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigDeprecation)
        parse_config(data, base_dir=Path("."))
    assert named in str(err.value)


def test_the_families_own_keys_and_ttt_defaults_still_load():
    from eaglekit.config import parse_config

    for train in (
        # the demo's config switched to a block drafter (README): ttt.steps 4 stays, and does nothing there
        {"draft": {"architecture": "dflash", "block_size": 8, "num_key_value_heads": 2}, "ttt": {"steps": 4}},
        {"draft": {"architecture": "mla", "norm_before_fc": False}},  # a flag left off asks nothing
        {"draft": {"architecture": "dspark", "markov_rank": 64}},
        {"draft": {"architecture": "mla", "kv_lora_rank": 64, "fc_norm": True}},
        {"draft": {"sliding_window": 2048, "head_dim": 64}, "ttt": {"loss": "jsd"}},
    ):
        data = {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}, "train": train}
        parse_config(data, base_dir=Path("."))


# The train.draft keys each family read before train.draft became one model per family (config.DRAFT_KEYS was
# this table, written by hand): their models read the same.
_SHAPE = {"architecture", "intermediate_size", "num_attention_heads"}
_FLAGS = {"fc_norm", "norm_output", "norm_before_residual"}
_BLOCK = {"block_size", "num_layers", "mask_token_id", "max_anchors", "position_weighting", "dpace_alpha", "decay_gamma",
          "shared_k_norm", "num_key_value_heads", "head_dim", "sliding_window"}  # fmt: skip
KEYS_BEFORE = {
    "llama": _SHAPE | _FLAGS | {"hidden_size", "num_key_value_heads", "head_dim", "norm_before_fc", "sliding_window"},
    "mla": _SHAPE
    | _FLAGS
    | {"hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"},  # fmt: skip
    "dflash": _SHAPE | _BLOCK,
    "dspark": _SHAPE | _BLOCK | {"markov_rank"},
}


# and the keys a family gained since
KEYS_SINCE = {"llama": {"num_layers"}}  # several draft layers, as vLLM's llama_eagle3.py serves them


def test_each_family_has_a_model_of_its_own_keys_picked_by_architecture():
    for name, keys in KEYS_BEFORE.items():  # a family added since has keys of its own
        now = keys | KEYS_SINCE.get(name, set())
        assert set(DRAFT_MODELS[name].model_fields) == now == DRAFT_KEYS[name], name
    for architecture, model in [(None, LlamaDraft), ("llama", LlamaDraft), ("mla", MlaDraft), ("dflash", DFlashDraft),
                                ("dspark", DSparkDraft)]:  # fmt: skip
        draft = parse_config({**BASE, "train": {"draft": {"architecture": architecture}}}).train.draft
        assert type(draft) is model and draft.family == (architecture or "llama")
    assert issubclass(DSparkDraft, DFlashDraft) and not hasattr(DFlashDraft(), "fc_norm")


def test_a_key_of_another_family_is_refused_when_set_and_ignored_when_null():
    """Set, it is refused as it loads and as it is assigned; null or false (every key a RUN_DIR/config.yaml of an
    earlier eaglekit holds) it asks nothing and loads. A mask token 0 loaded before (a false-like value)."""
    with pytest.raises(
        UsageError, match=re.escape(f"architecture llama does not read mask_token_id ({readers('mask_token_id')})")
    ):
        parse_config({**BASE, "train": {"draft": {"mask_token_id": 0}}})
    cfg = parse_config({**BASE, "train": {"draft": {"architecture": "dflash", "fc_norm": False, "q_lora_rank": None}}})
    with pytest.raises(
        ValueError, match=re.escape(f"architecture dflash does not read norm_before_fc ({readers('norm_before_fc')})")
    ):
        cfg.train.draft.norm_before_fc = True
    with pytest.raises(UsageError, match=r"unknown key 'train.draft.block_sise'"):  # no family's: a typo
        parse_config({**BASE, "train": {"draft": {"architecture": "dflash", "block_sise": 8}}})
    cfg.train.draft = {"architecture": "mla", "kv_lora_rank": 64}  # another family: the section is validated anew
    assert type(cfg.train.draft) is MlaDraft and cfg.train.draft.kv_lora_rank == 64


@pytest.mark.parametrize("architecture", ["llama", "mla", "dflash", "dspark"])
def test_a_dump_names_every_familys_keys_and_loads_back(tmp_path, architecture):
    """RUN_DIR/config.yaml (and train's fingerprint, which hashes the same dump) holds every family's train.draft
    key, null where the family has none, as before the union: a run trained before is not made stale."""
    cfg = parse_config({**BASE, "train": {"draft": {"architecture": architecture, "num_attention_heads": 4}}})
    dumped = cfg.train.model_dump()["draft"]
    assert set(dumped) == set(every_draft_key()) >= set().union(*KEYS_BEFORE.values())
    windowed = {"sliding_window"} & DRAFT_KEYS[architecture]  # "auto", its default (train's params hold what it chose)
    assert {key for key, value in dumped.items() if value is not None} == {"architecture", "num_attention_heads",
                                                                             *windowed}  # fmt: skip
    again = load_config(write_config(tmp_path / "c.yaml", yaml.safe_load(cfg.to_yaml())))  # the whole dump
    assert again.train.draft == cfg.train.draft and again.extract == cfg.extract


class _ExtraDraft(DraftSection):
    """A family's train.draft model that only the test below registers."""

    architecture: Literal["extra"] = "extra"
    depth: int | None = Field(None, ge=1, description="a key only this family reads")


def test_a_draft_model_added_to_the_table_is_a_family_the_config_loads(tmp_path, monkeypatch):
    """A family's config is its model and its line in DRAFT_MODELS: the table is read as each config loads, so a
    model added at run time (as tests/drafters/test_drafter_registry.py's toy family is) validates, refuses another family's
    keys, is refused its own by the others, dumps every family's keys and loads back, as the built-in ones do."""
    monkeypatch.setitem(DRAFT_MODELS, "extra", _ExtraDraft)
    cfg = parse_config({**BASE, "train": {"draft": {"architecture": "extra", "depth": 3}}})
    assert type(cfg.train.draft) is _ExtraDraft and cfg.train.draft.depth == 3
    with pytest.raises(UsageError, match=r"'train.draft.depth': Input should be greater than or equal to 1"):
        parse_config({**BASE, "train": {"draft": {"architecture": "extra", "depth": 0}}})
    with pytest.raises(
        UsageError, match=re.escape(f"architecture extra does not read block_size ({readers('block_size')})")
    ):
        parse_config({**BASE, "train": {"draft": {"architecture": "extra", "block_size": 4}}})
    with pytest.raises(UsageError, match=r"architecture dflash does not read depth \(extra\)"):
        parse_config({**BASE, "train": {"draft": {"architecture": "dflash", "depth": 3}}})
    dumped = yaml.safe_load(cfg.to_yaml())
    assert dumped["train"]["draft"]["depth"] == 3 and dumped["train"]["draft"]["block_size"] is None
    assert load_config(write_config(tmp_path / "c.yaml", dumped)).train.draft == cfg.train.draft


@pytest.mark.parametrize("transport", ["file", "mooncake"])
def test_a_streamed_runs_dump_loads_back(tmp_path, transport):
    """The dump holds extract.stream.mooncake's defaults with either transport: RUN_DIR/config.yaml loads back."""
    extract = {
        "mode": "stream",
        "backend": "vllm",
        "stream": {"transport": transport},
        "vllm": {"servers": ["http://127.0.0.1:9/v1"], "storage_path": str(tmp_path)},
    }
    cfg = parse_config({**BASE, "extract": extract})
    again = load_config(write_config(tmp_path / "c.yaml", yaml.safe_load(cfg.to_yaml())))
    assert again.extract == cfg.extract
    with pytest.raises((UsageError, ValueError), match="mooncake is set but transport is 'file'"):
        parse_config({**BASE, "extract": {**extract, "stream": {"mooncake": {"master_server_address": "h:1"}}}})


def test_storage_path_is_needed_only_where_the_servers_write_files(tmp_path):
    """extract.vllm.storage_path is where the file transport reads the servers' files (offline extraction, a stream
    with transport file): left out there, the config load names it; with transport mooncake nothing reads it."""
    servers = {"servers": ["http://127.0.0.1:9/v1"]}
    stream = {"mode": "stream", "backend": "vllm", "vllm": servers}
    mooncake = load_config(
        write_config(tmp_path / "m.yaml", {**BASE, "extract": {**stream, "stream": {"transport": "mooncake"}}})
    )
    assert mooncake.extract.vllm is not None and mooncake.extract.vllm.storage_path is None
    again = load_config(write_config(tmp_path / "again.yaml", yaml.safe_load(mooncake.to_yaml())))  # RUN_DIR's dump
    assert again.extract == mooncake.extract
    for extract, reader, or_mooncake in (
        (stream, "train's stream (extract.stream.transport file)", True),
        ({**stream, "stream": {"transport": "file"}}, "train's stream (extract.stream.transport file)", True),
        ({**stream, "mode": "offline"}, "offline extraction", False),
    ):
        path = write_config(tmp_path / "f.yaml", {**BASE, "extract": extract})
        with pytest.raises(UsageError) as err:
            load_config(path)
        assert err.value.message.startswith(f"{path}: extract.vllm.storage_path is not set: {reader}"), err.value
        assert (err.value.remedy or "").startswith("set extract.vllm.storage_path to the servers' shared_storage_path")
        assert ("extract.stream.transport: mooncake" in (err.value.remedy or "")) == or_mooncake


def test_a_family_reads_its_keys_from_the_section_it_is_given():
    """DFlash's objective asks train.draft as its model: a DSpark section is one (it extends DFlash's); a Llama
    section (a finetune of a DFlash folder with the architecture unset) gives the keys the two share."""
    spark = parse_config({**BASE, "train": {"draft": {"architecture": "dspark", "max_anchors": 8}}}).train
    assert spark.draft_as(DFlashDraft) is spark.draft and spark.draft_as(DFlashDraft).max_anchors == 8
    llama = parse_config({**BASE, "train": {"draft": {"num_attention_heads": 4, "fc_norm": True}}}).train
    assert llama.draft_as(DFlashDraft) == DFlashDraft(num_attention_heads=4)


# Each value means nothing for its key; before the bounds, every one of them was accepted (inf passes `gt=0`, K 0 and
# negative temperatures had no bound, a seed past numpy's range stopped train with "Seed must be between 0 and
# 2**32 - 1", a zero head count was a ZeroDivisionError inside a pre-flight check).
OUT_OF_BOUNDS = [
    ("train.lr", float("inf"), "finite"),
    ("train.lr", float("nan"), "finite"),
    ("train.grad_clip", float("inf"), "finite"),
    ("generate.timeout", float("inf"), "finite"),
    ("generate.temperature", float("inf"), "finite"),
    ("train.ttt.step_weights", [1.0, float("nan")], "finite"),
    ("evaluate.num_speculative_tokens", [3, 0], "greater than or equal to 1"),
    ("evaluate.num_speculative_tokens", [], "at least 1 item"),
    ("evaluate.temperatures", [0.0, -0.5], "greater than or equal to 0"),
    ("evaluate.temperatures", [float("inf")], "finite"),
    ("verify.num_speculative_tokens", [-2], "greater than or equal to 1"),
    ("train.seed", 2**32, "less than 4294967296"),
    ("evaluate.seed", -1, "greater than or equal to 0"),
    ("generate.seed", 2**70, "less than 4294967296"),
    ("generate.max_tokens", 2**64, "64 bits"),
    ("train.draft.num_attention_heads", 0, "greater than or equal to 1"),
    ("train.draft.hidden_size", -64, "greater than or equal to 1"),
    ("target.aux_layers", [2, -1, 5], "greater than or equal to 0"),
    ("run_dir", "", "at least 1 character"),
    ("target.model", "", "at least 1 character"),
    ("data.prompts", "", "at least 1 character"),
    ("run_dir", "   ", "blank"),
]


def _with(key: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *sections, leaf = key.split(".")
    node = data
    for s in sections:
        node = node.setdefault(s, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize("key, value, says", OUT_OF_BOUNDS, ids=[f"{k}={v!r}" for k, v, _ in OUT_OF_BOUNDS])
def test_values_without_meaning_are_refused_by_name(tmp_path, key, value, says):
    with pytest.raises(UsageError) as e:
        load_config(write_config(tmp_path / "c.yaml", _with(key, value)))
    named = [line for line in e.value.message.splitlines() if line.startswith(f"  - '{key}")]
    assert len(named) == 1 and says in named[0], e.value.message


def test_bounds_leave_the_edges_that_mean_something(tmp_path):
    edges = {
        **BASE,
        "generate": {"temperature": 0.0, "seed": 2**32 - 1},
        "evaluate": {"num_speculative_tokens": [1], "temperatures": [0.0]},
        "train": {"lr": 1e-12, "seed": 0, "draft": {"num_attention_heads": 1}},
    }
    cfg = load_config(write_config(tmp_path / "c.yaml", edges))
    assert cfg.generate.seed == 2**32 - 1 and cfg.evaluate.num_speculative_tokens == [1]


def test_a_huge_value_is_quoted_short(tmp_path):
    data = {**BASE, "generate": {"max_tokens": 10**300}, "target": {"model": "m", "device_map": ["x" * 10_000]}}
    with pytest.raises(UsageError) as e:
        load_config(write_config(tmp_path / "c.yaml", data))
    assert "an integer of 997 bits" in e.value.message
    assert max(len(line) for line in e.value.message.splitlines()) < 200


@pytest.mark.parametrize("layout", ["run_dir is a file", "run_dir is under a file"])
def test_run_dir_must_be_able_to_be_a_directory(tmp_path, layout):
    (tmp_path / "taken").write_text("not a folder")
    run_dir = "taken" if layout == "run_dir is a file" else "taken/run"
    with pytest.raises(UsageError) as e:
        load_config(write_config(tmp_path / "c.yaml", {**BASE, "run_dir": run_dir}))
    assert f"{tmp_path / 'taken'} is a file" in e.value.message


def test_yaml_numbers_and_nesting_python_cannot_read_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"run_dir: run\ngenerate: {{seed: {'9' * 5000}}}\n")
    with pytest.raises(UsageError, match="a value YAML cannot read"):
        load_config(path)
    path.write_text("run_dir: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(UsageError, match="nested deeper"):
        load_config(path)


# Every train key that moved under train.ttt, with a value away from its default, in its old spelling and its new one.
OLD_TRAIN = {
    "ttt_steps": 3,
    "ttt_decay": 0.7,
    "loss": "lk_hybrid",
    "lk_eta": 2.0,
    "step_weights": [1.0, 0.5, 0.25],
    "loss_normalization": "sequence",
    "noise": "gaussian",
    "noise_scale": 0.1,
    "anchor_weight": 4.0,
    "activation_checkpointing": True,
    "attention": "sdpa",
    "head_loss": "reference",
    "compile": True,
}
NEW_TTT = {
    "steps": 3,
    "decay": 0.7,
    "loss": {"name": "lk_hybrid", "eta": 2.0},
    "step_weights": [1.0, 0.5, 0.25],
    "loss_normalization": "sequence",
    "noise": "gaussian",
    "noise_scale": 0.1,
    "anchor_weight": 4.0,
    "activation_checkpointing": True,
    "attention": "sdpa",
    "head_loss": "reference",
    "compile": True,
}


def test_the_old_flat_ttt_spellings_load_the_same_config_with_a_warning_naming_both(tmp_path):
    assert set(OLD_TRAIN) == set(TTT_MOVED)  # every moved key is exercised
    new = load_config(write_config(tmp_path / "new.yaml", {**BASE, "train": {"lr": 0.01, "ttt": NEW_TTT}}))
    old_file = write_config(tmp_path / "old.yaml", {**BASE, "train": {"lr": 0.01, **OLD_TRAIN}})
    with pytest.warns(ConfigDeprecation) as caught:
        old = load_config(old_file)
    assert old.train == new.train and old.train.ttt.loss.eta == 2.0  # type: ignore[attr-defined]
    assert {w.filename for w in caught} == {str(old_file)}  # shown as the config file's, not config.py's
    lines = old_file.read_text().splitlines()
    for w in caught:  # at the line of the old key in the file
        assert lines[w.lineno - 1].strip().startswith(f"{w.message.key}:"), (w.lineno, w.message)  # type: ignore[union-attr]
    said = sorted(str(w.message) for w in caught)
    assert said == sorted(
        f"train.{key} is an old spelling: write train.{TTT_MOVED[key]} (the old one still loads, for now)"
        for key in OLD_TRAIN
    )
    assert pipeline.fingerprint(old, "train") == pipeline.fingerprint(new, "train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns about nothing
        load_config(write_config(tmp_path / "new.yaml", {**BASE, "train": {"ttt": NEW_TTT}}))


def test_an_old_and_a_new_spelling_of_one_key_together_are_refused(tmp_path):
    both = {**BASE, "train": {"ttt_steps": 3, "ttt": {"steps": 5}}}
    with pytest.raises(UsageError, match=r"train.ttt_steps and train.ttt.steps are both set: keep train.ttt.steps"):
        load_config(write_config(tmp_path / "c.yaml", both))


def test_a_config_eaglekit_wrote_before_loads_as_it_was(tmp_path):
    """RUN_DIR/config.yaml of an earlier eaglekit is a full dump in the flat spelling, lk_eta 3.0 beside kl_div
    included (here a real one: the train section the τ race recorded in benchmarks/race-ledger.jsonl)."""
    ledger = Path(__file__).resolve().parents[2] / "benchmarks" / "race-ledger.jsonl"
    written = json.loads(ledger.read_text().splitlines()[0])["settings"]["eaglekit"]
    assert written["lk_eta"] == 3.0 and written["loss"] == "kl_div" and "ttt_steps" in written
    with pytest.warns(ConfigDeprecation):
        cfg = load_config(write_config(tmp_path / "c.yaml", {**BASE, "train": written}))
    assert cfg.train.ttt == TTTConfig(steps=4)
    with pytest.warns(ConfigDeprecation):  # and as a block drafter's: every TTT key at its default asks nothing
        load_config(
            write_config(tmp_path / "c.yaml", {**BASE, "train": {**written, "draft": {"architecture": "dflash"}}})
        )

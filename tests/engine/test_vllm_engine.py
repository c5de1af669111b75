"""The real vLLM (CPU build, its own venv) serving the tiny target: the launcher, and generate through it.

What is pinned here was seen in vLLM 0.32 with ``--reasoning-parser qwen3``: reasoning arrives in
``message.reasoning`` (docs/formats.md §5), ``return_token_ids`` gives the completion's token ids, and at
temperature 0 in float32 they are the ids the in-process (transformers) backend generates.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.responses import read_responses
from eaglekit.errors import EaglekitError
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.serving.engine import VllmServer, metric_sum, parse_prometheus

pytestmark = pytest.mark.slow  # builds, trains or serves models

N_PROMPTS = 6


@pytest.fixture(scope="module")
def vllm_tiny(vllm_python, tiny_target, tmp_path_factory):
    """A real vLLM serving the tiny target with its reasoning parser."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VllmServer(vllm_python, str(tiny_target), ["--reasoning-parser", "qwen3", "--max-model-len", "1024"], log)
    with server:
        yield server


def run_generate(tmp_path: Path, name: str, target: Path, prompts: Path, **generate) -> list[dict]:
    cfg = parse_config(
        {
            "run_dir": str(tmp_path / name),
            "target": {"model": str(target), "dtype": "float32"},
            "data": {"prompts": str(prompts)},
            "generate": {"max_tokens": 200, "gate_samples": 3, **generate},
        },
        base_dir=tmp_path,
    )
    if generate.get("backend") == "openai":
        results = pipeline.run_preflight(pipeline.make_context(cfg, "generate"))
        assert not failed(results), [r.to_dict() for r in failed(results)]
        smoke = next(r for r in results if r.name.startswith("smoke"))
        assert "reasoning from `reasoning`" in smoke.detail, smoke.detail
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "generate", skip_preflight=True)
    return sorted(read_responses(Path(cfg.run_dir) / "generate" / "responses.jsonl"), key=lambda r: r["id"])


def test_generate_through_real_vllm_matches_the_local_backend(tmp_path, vllm_tiny, tiny_target):
    from eaglekit.tiny import write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", N_PROMPTS, seed=11)
    served = run_generate(
        tmp_path,
        "served",
        tiny_target,
        prompts,
        backend="openai",
        servers=[vllm_tiny.url],
        model=vllm_tiny.model,
        concurrency=3,
        timeout=120,
    )
    local = run_generate(tmp_path, "local", tiny_target, prompts, backend="local", batch_size=3)

    assert [r["id"] for r in served] == [r["id"] for r in local] and len(served) == N_PROMPTS
    for s, lo in zip(served, local, strict=False):
        assert s["reasoning_source"] == "reasoning", s  # vLLM >= 0.16 with a reasoning parser
        assert s["reasoning"] and s["content"] and "</think>" not in s["content"]
        assert s["server"] == vllm_tiny.url and s["finish_reason"] == "stop"
        # the engine generated exactly what the model generates in-process: same tokens, same split
        assert s["completion_token_ids"] == lo["completion_token_ids"], s["id"]
        assert (s["reasoning"].strip(), s["content"].strip()) == (lo["reasoning"].strip(), lo["content"].strip())

    metrics = vllm_tiny.metrics()
    assert metric_sum(metrics, "vllm:request_success_total") >= N_PROMPTS + 1  # + the pre-flight's smoke request


def test_a_server_that_cannot_start_is_an_error_quoting_its_log(vllm_python, tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    server = VllmServer(vllm_python, str(bad), [], tmp_path / "vllm.log", startup_timeout=300)
    with pytest.raises(EaglekitError) as err, server:
        pass
    assert "exited with code" in err.value.message and str(tmp_path / "vllm.log") in err.value.message
    assert server.process.poll() is not None  # nothing left running
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/models", timeout=2)


def test_prometheus_text_is_parsed_by_name_and_labels():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 31.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 22.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="1",position="1"} 3.0',
            "process_open_fds 12",
        ]
    )
    metrics = parse_prometheus(text)
    assert metrics['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}'] == 40.0
    assert metrics["process_open_fds"] == 12.0
    assert metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 25.0
    assert metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 56.0
    assert metric_sum(metrics, "vllm:absent_total") == 0.0

"""The generate stage end to end against a real server: `transformers serve` hosting the tiny target.

transformers serve validates request fields strictly (it answers 422 to vLLM's ``return_token_ids``),
reports no ``max_model_len`` and no ``/version``, and returns reasoning as ``reasoning_content`` only
when the model has a response template — otherwise inline in ``content``. The stage must cope with all
of that and still capture the reasoning, pre-flight (smoke request and render check) included.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.prompts import load_prompts
from eaglekit.data.responses import read_responses
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow  # builds, trains or serves models

STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    """(base URL, model id) of `transformers serve` hosting the tiny target from its local folder."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:  # an environment without the transformers[serving] extra
        pytest.skip(f"transformers serve needs {', '.join(missing)} (pip install 'transformers[serving]')")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "transformers.cli.transformers",
                "serve",
                str(tiny_target),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"transformers serve did not answer /health in {STARTUP_SECONDS}s:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield url + "/v1", str(tiny_target)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_generate_through_transformers_serve(tmp_path, served, capsys):
    from eaglekit.tiny import write_prompts

    url, model_id = served
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, seed=5)
    cfg = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": model_id},
            "data": {"prompts": str(prompts)},
            # the default return_token_ids (true) is kept on purpose: the client must drop it when refused
            "generate": {
                "backend": "openai",
                "servers": [url],
                "model": model_id,
                "max_tokens": 256,
                "concurrency": 2,
                "timeout": 120,
                "gate_samples": 3,
            },
        },
        base_dir=tmp_path,
    )

    results = pipeline.run_preflight(pipeline.make_context(cfg, "generate"))
    assert not failed(results), [r.to_dict() for r in failed(results)]
    assert next(r for r in results if r.name == "reasoning").detail.startswith("required")  # the template thinks
    smoke = next(r for r in results if r.name.startswith("smoke"))
    assert "reasoning from `" in smoke.detail

    with RunDir(cfg.run_dir).lock:
        out = pipeline.run_stage(cfg, "generate", skip_preflight=True)
    rows = list(read_responses(Path(cfg.run_dir) / "generate" / "responses.jsonl"))
    expected_ids = sorted(r.id for r in load_prompts(prompts).records)
    assert sorted(r["id"] for r in rows) == expected_ids
    for r in rows:
        assert r["reasoning_source"] in ("inline_think", "reasoning_content"), r
        assert r["reasoning"] and r["content"] and "<think>" not in r["content"] and "</think>" not in r["content"]
        assert r["server"] == url and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
    assert out["counts"]["empty_reasoning"] == 0
    assert "refuses `return_token_ids`" in capsys.readouterr().err

"""Server health on real HTTP servers (127.0.0.1): vLLM's /health answers 503 once its engine died while /v1/models
still answers; SGLang's /health_generate runs a generation."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import pytest
from support.fake_vllm import FakeVLLM
from support.json_http import JsonHandler

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.preflight import failed
from eaglekit.preflight import servers as serving

MODEL = "fake/reasoner"


def ctx_for(tmp_path, url: str):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    cfg = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": "org/absent"},
            "data": {"prompts": str(tmp_path / "p.jsonl")},
            "generate": {"backend": "openai", "servers": [url], "model": MODEL, "reasoning": "required"},
        },
        base_dir=tmp_path,
    )
    return pipeline.make_context(cfg, "generate")


def test_a_vllm_whose_engine_died_fails_health_and_the_stage_preflight(tmp_path):
    with FakeVLLM(model=MODEL, health_status=503) as dead:
        [result] = serving.health(ctx_for(tmp_path, dead.url))
        assert result.status == "fail" and "/health answers HTTP 503" in result.detail and "restart" in result.remedy
        bad = failed(pipeline.run_preflight(ctx_for(tmp_path, dead.url)))
        assert [r.name for r in bad] == [f"health {dead.url}"]


def test_a_healthy_vllm_passes(tmp_path):
    with FakeVLLM(model=MODEL) as alive:
        [result] = serving.health(ctx_for(tmp_path, alive.url))
        assert result.status == "ok" and "/health answers 200" in result.detail


class SGLangLike(JsonHandler):
    generate_status = 200

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"data": [{"id": MODEL, "max_model_len": 4096}]})
        elif self.path == "/get_model_info":
            self.send_json(200, {"model_path": "/models/x"})
        elif self.path == "/health_generate":
            self.send_json(self.generate_status, {})
        else:
            self.send_json(404, {})


@pytest.mark.parametrize("status, verdict", [(200, "ok"), (503, "fail")])
def test_sglang_health_generate(tmp_path, status, verdict):
    handler = type("Handler", (SGLangLike,), {"generate_status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        [result] = serving.health(ctx_for(tmp_path, f"http://127.0.0.1:{server.server_address[1]}/v1"))
        assert result.status == verdict and "/health_generate" in result.detail
    finally:
        server.shutdown()
        server.server_close()

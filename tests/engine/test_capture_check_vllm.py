"""The capture self-check against the real vLLM CPU build, started with layer ids shifted by one.

The right capture and a final norm applied twice are checked on test_extract_vllm.py's server (one engine
start for those); this one needs a server of its own, since a server's layer ids are fixed when it starts.
"""

from __future__ import annotations

import pytest
from test_extract_vllm import vllm_run

from eaglekit.pipeline import make_context, run_preflight
from eaglekit.serving.engine import VllmServer
from eaglekit.serving.vllm_features import plugin_dir, serve_args

ASKED = [2, 4, 5, 8]  # what the run's config asks for: the tiny target's default aux taps and layer 8
SHIFTED = [i - 1 for i in ASKED]  # an off-by-one layer-id convention on the server's side


@pytest.fixture(scope="module")
def shifted_server(vllm_python, tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("shifted-server")
    storage = root / "hidden-states"
    storage.mkdir()
    args = ["--max-model-len", "1024", *serve_args(SHIFTED, str(storage), "cpu")]
    server = VllmServer(vllm_python, str(tiny_target), args, root / "vllm.log", env={"PYTHONPATH": str(plugin_dir())})
    with server:
        yield server, storage


def test_capture_self_check_fails_naming_shifted_layer_ids(tmp_path, tiny_target, shifted_server):
    server, storage = shifted_server
    cfg = vllm_run(tmp_path, tiny_target, storage, [server.url], server.model)
    results = run_preflight(make_context(cfg, "extract"))
    capture = next(r for r in results if r.name.startswith("capture self-check"))
    assert capture.status == "fail", capture.detail
    assert "does not capture layer 8" in capture.detail and f"shifted from {ASKED}" in capture.detail
    assert "serve-command" in capture.remedy

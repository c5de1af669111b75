"""extract.backend vllm against the real vLLM CPU build (its own venv): features equal the hf backend's, a
drafter trained on them learns the same, dead and broken servers are rotated out, pre-flight catches a
target that does not match the server.

The server runs the ``extract_hidden_states`` method with eaglekit's CPU-capable connector (the stock one
cannot write on a CPU build: it copies through pinned memory), in float32 so the comparison can be tight.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.helpers import FEATURE_LAYERS
from support.json_http import JsonHandler
from test_extract import prepared_run

from eaglekit.data import shards as sh
from eaglekit.errors import EaglekitError
from eaglekit.pipeline import fingerprint, make_context, run_preflight, run_stage
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.serving.engine import free_port
from eaglekit.serving.vllm_features import (
    FeatureClient,
    ServerSetupError,
    TokenMismatch,
    plugin_dir,
    serve_command,
    stacked_positions,
)

pytestmark = pytest.mark.slow  # builds, trains or serves models

TRAIN = {
    "ttt": {"steps": 3},
    "batch_size": 4,
    "lr": 1e-3,
    "warmup_steps": 2,
    "eval_samples": 8,
    "max_steps": 6,
    "eval_every": 6,
    "save_every": 6,
    "log_every": 1,
    "dtype": "float32",
}


@pytest.fixture
def feature_server(feature_servers):
    """A real vLLM serving the tiny target as a feature source, and its storage folder (conftest's, shared with
    the stream tests)."""
    (server,), storage = feature_servers(1)
    return server, storage


def vllm_run(path: Path, target: Path, storage: Path, servers: list[str], served: str, **vllm):
    return prepared_run(
        path,
        target,
        n=40,
        train=TRAIN,
        extract={
            "mode": "offline",
            "dtype": "float32",
            "shard_tokens": 900,
            "backend": "vllm",
            "vllm": {
                "servers": servers,
                "storage_path": str(storage),
                "connector": "cpu",
                "model": served,
                "concurrency": 4,
                "timeout": 120,
                "retry_backoff": 0.05,
                "probe_interval": 600,
                **vllm,
            },
        },
    )


def train_rows(cfg) -> list[dict]:
    lines = (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_vllm_features_equal_hf_features_and_train_the_same_drafter(tmp_path, tiny_target, feature_server):
    server, storage = feature_server
    hf = prepared_run(
        tmp_path / "hf",
        tiny_target,
        n=40,
        train=TRAIN,
        extract={"mode": "offline", "dtype": "float32", "shard_tokens": 900},
    )
    vl = vllm_run(tmp_path / "vllm", tiny_target, storage, [server.url], server.model)

    results = run_preflight(make_context(vl, "extract"))
    assert not failed(results), [r.to_dict() for r in failed(results)]
    smoke = next(r for r in results if r.name.startswith("feature smoke"))
    assert smoke.status == "ok" and "next token" in smoke.detail, smoke.detail  # server's token == ours
    capture = next(r for r in results if r.name.startswith("capture self-check"))
    assert capture.status == "ok" and "max |Δ|" in capture.detail, capture.detail  # the rows give vLLM's log-probs
    for cfg in (hf, vl):
        with RunDir(cfg.run_dir).lock:
            row = run_stage(cfg, "extract", skip_preflight=cfg is hf)
            run_stage(cfg, "train")
    assert row["counts"]["backend"] == "vllm" and row["counts"]["samples"] == 40
    assert list(storage.iterdir()) == []  # every request's file and lock were deleted once converted

    a, b = sh.FeatureStore(Path(hf.run_dir) / "extract"), sh.FeatureStore(Path(vl.run_dir) / "extract")
    assert a.shard_members() == b.shard_members()
    for sid in a.where:  # the same states: aux taps, and the final state through the target's norm
        for x, y in zip(a.features(sid), b.features(sid), strict=False):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)

    ra, rb = train_rows(hf), train_rows(vl)
    assert [(r["kind"], r["step"]) for r in ra] == [(r["kind"], r["step"]) for r in rb]
    for x, y in zip(ra, rb, strict=False):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
    tau = [json.loads((Path(c.run_dir) / "train" / "summary.json").read_text())["tau"] for c in (hf, vl)]
    assert tau[1] == pytest.approx(tau[0], abs=1e-3)


class BrokenFeatureServer:
    """Answers like a feature server whose process dies while writing: the lock appears and is released,
    the file never does."""

    def __init__(self, storage: Path, model: str):
        self.storage, self.model, self.requests = storage, model, 0
        owner = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.send_json(200, {"data": [{"id": owner.model, "max_model_len": 1024}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                owner.requests += 1
                path = owner.storage / f"cmpl-{body['request_id']}-0-broken.safetensors"
                Path(str(path) + ".lock").touch()
                self.send_json(
                    200,
                    {
                        "choices": [{"text": "", "token_ids": [1]}],
                        "kv_transfer_params": {"hidden_states_path": str(path)},
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_dead_and_broken_servers_are_rotated_out(tmp_path, tiny_target, feature_server):
    """A server that refuses connections and one whose file never arrives: every sample still lands, on the
    real server; files a killed earlier run left in the storage folder are removed."""
    server, storage = feature_server
    broken = BrokenFeatureServer(storage, server.model)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cfg = vllm_run(tmp_path, tiny_target, storage, [dead, broken.url, server.url], server.model)
    leftover = storage / f"cmpl-ek{fingerprint(cfg, 'extract')[:10]}-r0-7-1-0-0badc0de.safetensors"
    leftover.write_bytes(b"torn")
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract", skip_preflight=True)
    broken.httpd.shutdown()
    # once its first file is found missing it is out (probed again only after 600 s): it got at most what
    # was in flight by then (measured: 4 of the 40 samples, its concurrency), never every sample
    assert row["counts"]["samples"] == 40 and 1 <= broken.requests <= 2 * 4 * 3
    assert list(storage.iterdir()) == []
    index = json.loads((Path(cfg.run_dir) / "extract" / sh.INDEX).read_text())
    assert sum(e["samples"] for e in index["shards"]) == 40


def test_preflight_fails_when_the_targets_head_does_not_predict_the_servers_token(
    tmp_path, tiny_target, feature_server
):
    """target.model names a checkpoint whose lm_head differs from the served one: the smoke request's
    next-token check names it (the same check catches a server that captures another final state)."""
    server, storage = feature_server
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"].roll(7, dims=0).contiguous()
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    cfg = vllm_run(tmp_path / "run", other, storage, [server.url], server.model)
    results = run_preflight(make_context(cfg, "extract"))
    smoke = next(r for r in results if r.name.startswith("feature smoke"))
    assert smoke.status == "fail" and "does not predict the server's token" in smoke.detail, smoke.detail
    assert "serve-command" in smoke.remedy


def test_capture_self_check_names_a_final_norm_applied_twice(tmp_path, tiny_target, feature_server, monkeypatch):
    """The rows are the server's final state normed twice: the check rebuilds vLLM's prompt_logprobs with the
    norm applied once and says that the rows were not made so."""
    import eaglekit.preflight.feature_servers as feature_servers
    from eaglekit.model.target import FinalNorm

    class TwiceNorm(FinalNorm):
        def __call__(self, x):
            return super().__call__(super().__call__(x))

    read = feature_servers.read_final_norm
    monkeypatch.setattr(
        feature_servers, "read_final_norm", lambda t: (lambda n: TwiceNorm(n.weight, n.eps, n.offset))(read(t))
    )
    server, storage = feature_server
    cfg = vllm_run(tmp_path, tiny_target, storage, [server.url], server.model)
    results = run_preflight(make_context(cfg, "extract"))
    capture = next(r for r in results if r.name.startswith("capture self-check"))
    assert capture.status == "fail", capture.detail
    assert "norm applied once" in capture.detail and "made with the final norm applied twice" in capture.detail


# ------------------------------------------------------------------ without a server: the file protocol


class _Cfg:
    servers, concurrency, timeout, max_retries, retry_backoff, probe_interval, outage_timeout = [], 1, 5, 0, 0, 1, 1

    def __init__(self, storage):
        self.storage_path = str(storage)


class _Reply:
    server = "http://127.0.0.1:1/v1"
    data = {"choices": [{"token_ids": [3]}]}
    attempts = 1


def client_for(storage: Path, hidden: int = 4) -> FeatureClient:
    from eaglekit.model.target import FinalNorm

    return FeatureClient(
        _Cfg(storage), None, "m", FEATURE_LAYERS, hidden, FinalNorm(torch.ones(hidden), 1e-6), "ektest"
    )


def test_the_file_is_read_after_its_lock_checked_converted_and_deleted(tmp_path):
    """The reader sleeps while the server's writer holds LOCK_EX on the .lock (vLLM's protocol); layers come back
    in vLLM's ascending order whatever order they were asked in; the final state is normed."""
    client = client_for(tmp_path)
    client.layer_ids, client.positions = [5, 2, 4, 8], stacked_positions([5, 2, 4, 8])
    states = torch.arange(3 * 4 * 4, dtype=torch.float32).reshape(3, 4, 4) + 1  # stacked as layers 2, 4, 5, 8
    path = tmp_path / "cmpl-ektest-0-1-0-ab.safetensors"
    lock = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # what the connector does before the response returns

    def write_then_release():
        time.sleep(0.3)
        save_file({"hidden_states": states, "token_ids": torch.tensor([7, 8, 9])}, str(path))
        os.close(lock)  # releases LOCK_EX, as the connector's writer thread does

    writer = threading.Thread(target=write_then_release)
    t0 = time.monotonic()
    writer.start()
    client.transport.wait_ready(client.transport.locate({"hidden_states_path": str(path)}, "server"))
    assert time.monotonic() - t0 >= 0.25 and path.exists()
    writer.join()
    seen = []
    cap = client._read(path, [7, 8, 9], _Reply(), 1, seen.append, 0)
    assert seen == [cap]
    assert torch.equal(cap.aux, torch.cat([states[:, 2], states[:, 0], states[:, 1]], dim=-1))
    final = states[:, 3]
    torch.testing.assert_close(cap.last_hidden, final / final.pow(2).mean(-1, keepdim=True).sqrt())
    assert cap.generated == 3 and list(tmp_path.iterdir()) == []


def test_other_tokens_and_other_layers_are_named_errors(tmp_path):
    client = client_for(tmp_path)
    path = tmp_path / "a.safetensors"
    save_file({"hidden_states": torch.zeros(3, 4, 4), "token_ids": torch.tensor([7, 8, 10])}, str(path))
    with pytest.raises(TokenMismatch, match="first difference at position 2"):
        client._read(path, [7, 8, 9], _Reply(), 1, None, 0)
    save_file({"hidden_states": torch.zeros(3, 3, 4), "token_ids": torch.tensor([7, 8, 9])}, str(path))
    with pytest.raises(ServerSetupError, match=r"shape \(3, 3, 4\); this config needs \[3, 4, 4\]"):
        client._read(path, [7, 8, 9], _Reply(), 1, None, 0)
    with pytest.raises(EaglekitError, match="not in .* here"):
        client.transport.locate({"hidden_states_path": "/server/side/elsewhere.safetensors"}, "server")
    with pytest.raises(ServerSetupError, match="without kv_transfer_params.hidden_states_path"):
        client.transport.locate({}, "server")


def test_serve_command_names_the_layers_connector_and_storage():
    stock = serve_command("/m/Kimi", FEATURE_LAYERS, "/shared/hs", "stock", "kimi", 8193)
    assert stock.startswith("vllm serve /m/Kimi --served-model-name kimi --max-model-len 8193")
    assert '"eagle_aux_hidden_state_layer_ids":[2,4,5,8]' in stock and '"ExampleHiddenStatesConnector"' in stock
    assert '"shared_storage_path":"/shared/hs"' in stock and "kv_connector_module_path" not in stock
    cpu = serve_command("/m/tiny", FEATURE_LAYERS, "/hs", "cpu", None, None)
    assert cpu.startswith(f"PYTHONPATH={plugin_dir()} python -m vllm.entrypoints.openai.api_server --model /m/tiny")
    assert (
        '"kv_connector":"EaglekitHiddenStatesConnector"' in cpu
        and '"kv_connector_module_path":"eaglekit_hidden_states"' in cpu
    )

"""extract.mode stream against the real vLLM CPU build, two servers sharing one storage folder (conftest.py's
feature_servers, kept for the session): a streamed run trains to the losses of the offline-shard run of the same config (the same data order,
the same features), with the servers' files on disk measured below the configured spool; one server killed with
SIGKILL mid-run is survived with the same losses (a step's features do not depend on which server answered); the
capture self-check runs on the stream's first requests; kill -9 of the trainer leaves nothing a rerun trips on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from support.helpers import subprocess_env
from support.json_http import JsonHandler
from test_extract import prepared_run

from eaglekit.pipeline import make_context, run_preflight, run_stage
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.serving import vllm_features

pytestmark = pytest.mark.slow  # serves models and trains

SPOOL_GB = 0.0015  # 1.5 MB: a few of the tiny target's request files (4 float32 states of 128 per token)
TRAIN = {
    "ttt": {"steps": 3},
    "batch_size": 4,
    "lr": 1e-3,
    "warmup_steps": 2,
    "eval_samples": 8,
    "max_steps": 16,
    "eval_every": 8,
    "save_every": 4,
    "log_every": 1,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def two_servers(feature_servers):
    """Two real vLLM feature servers of the tiny target writing into one shared storage folder (conftest's: the
    first is the one the extract tests use)."""
    return feature_servers(2)


def run_config(path: Path, target: Path, storage: Path, servers, mode: str):
    return prepared_run(
        path,
        target,
        n=40,
        train=TRAIN,
        extract={
            "mode": mode,
            "dtype": "float32",
            "shard_tokens": 900,
            "backend": "vllm",
            "stream": {"spool_gb": SPOOL_GB, "ahead": 2},
            "vllm": {
                "servers": [s.url for s in servers],
                "storage_path": str(storage),
                "connector": "cpu",
                "model": servers[0].model,
                "concurrency": 4,
                "timeout": 120,
                "retry_backoff": 0.05,
                "probe_interval": 600,
            },
        },
    )


def losses(cfg) -> list[tuple]:
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r["loss"]) for r in rows]


def assert_same_losses(got, want):
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in want]
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-3)


class DiskWatch:
    """The storage folder's size on disk, polled from outside the run."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            size = 0
            for p in list(self.folder.iterdir()):
                with contextlib.suppress(FileNotFoundError):
                    size += p.stat().st_size
            self.peak = max(self.peak, size)
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def offline_run(two_servers, tiny_target, tmp_path_factory):
    """The same config with the features extracted to shards first (by the same servers), then trained."""
    servers, storage = two_servers
    cfg = run_config(tmp_path_factory.mktemp("offline"), tiny_target, storage, servers, "offline")
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract", skip_preflight=True)
        run_stage(cfg, "train", skip_preflight=True)
    return cfg


def test_streamed_training_matches_offline_shards_within_the_spool(tmp_path, tiny_target, two_servers, offline_run):
    servers, storage = two_servers
    cfg = run_config(tmp_path, tiny_target, storage, servers, "stream")
    results = run_preflight(make_context(cfg, "train"))
    assert not failed(results), [r.to_dict() for r in failed(results)]
    assert {"feature spool", f"feature server {servers[1].url}"} <= {r.name for r in results}
    with DiskWatch(storage) as disk, RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "train", skip_preflight=True)
    report = row["counts"]["stream"]
    assert_same_losses(losses(cfg), losses(offline_run))
    assert not (Path(cfg.run_dir) / "extract").exists()  # nothing stored but the spool
    limit = SPOOL_GB * 1e9
    assert 0 < disk.peak <= limit and report["spool_peak_bytes"] <= limit, (disk.peak, report)
    assert report["bound"] in ("server-bound", "trainer-bound") and report["requests"] >= 16 * 4
    assert list(storage.iterdir()) == []
    summary = json.loads((Path(cfg.run_dir) / "train" / "summary.json").read_text())
    offline_tau = json.loads((Path(offline_run.run_dir) / "train" / "summary.json").read_text())["tau"]
    assert summary["tau"] == pytest.approx(offline_tau, abs=1e-3)


KILLED_TRAIN = textwrap.dedent("""
    import os, signal, sys
    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.serving import vllm_features
    from eaglekit.training import step_checkpoints

    saved = []
    save = step_checkpoints.Checkpoints.save
    def save_and_note(self, step, *args, **kwargs):
        save(self, step, *args, **kwargs)
        saved.append(step)
    step_checkpoints.Checkpoints.save = save_and_note

    receive = vllm_features.FileSpool.receive
    def die_with_a_file_unread(self, where):
        if saved and saved[-1] >= int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # the request's file and lock stay in the spool
        return receive(self, where)
    vllm_features.FileSpool.receive = die_with_a_file_unread
    cfg = load_config(sys.argv[1])
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train", skip_preflight=True)
""")


def test_kill_9_of_the_trainer_resumes_to_the_same_losses(tmp_path, tiny_target, two_servers, offline_run):
    """The trainer killed with SIGKILL while reading the spool after its step-8 checkpoint: its unread files stay
    behind; the rerun removes them, resumes at step 8 with the same data order and ends with the offline run's
    losses (which server answered a request changes nothing)."""
    servers, storage = two_servers
    cfg = run_config(tmp_path, tiny_target, storage, servers, "stream")
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_TRAIN, str(config), "8"],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert list(storage.glob("cmpl-eks*")), "the kill left no request file behind: the test proves nothing"
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "train", skip_preflight=True)
    assert row["counts"]["steps"] == TRAIN["max_steps"]
    assert_same_losses(losses(cfg), losses(offline_run))
    assert list(storage.iterdir()) == []


class StalledServer:
    """Lists the model, then never answers a completion (a hung engine): each request waits out the timeout."""

    def __init__(self, model: str):
        self.release, self.requests = threading.Event(), 0
        owner = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.send_json(200, {"data": [{"id": model, "max_model_len": 1024}]})

            def do_POST(self):
                owner.requests += 1
                owner.release.wait(120)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()


def test_a_stalled_server_is_taken_out_and_its_requests_go_to_the_other(
    tmp_path, tiny_target, two_servers, offline_run
):
    servers, storage = two_servers
    stalled = StalledServer(servers[0].model)
    try:
        cfg = run_config(tmp_path, tiny_target, storage, servers, "stream")
        cfg.extract.vllm.servers = [stalled.url, servers[0].url]
        cfg.extract.vllm.timeout = 5
        with RunDir(cfg.run_dir).lock:
            row = run_stage(cfg, "train", skip_preflight=True)
    finally:
        stalled.close()
    report = row["counts"]["stream"]
    assert stalled.requests >= 1 and report["requests_retried"] >= 1
    assert any(stalled.url in line and "timed out" in line for line in report["servers_out"]), report
    assert_same_losses(losses(cfg), losses(offline_run))
    assert list(storage.iterdir()) == []


def test_a_server_killed_mid_run_is_survived(tmp_path, tiny_target, two_servers, offline_run, monkeypatch):
    """SIGKILL to one server's process group after the stream's 20th answer: its requests in flight fail and go to
    the other, the run ends with the offline run's losses, the report names the server. (Last in the module: the
    second server stays dead; conftest's feature_servers starts another if a later test asks for two.)"""
    servers, storage = two_servers
    cfg = run_config(tmp_path, tiny_target, storage, servers, "stream")
    victim = servers[1]
    answered = [0]
    real = vllm_features.FeatureClient.capture

    async def capture(self, *args, **kwargs):
        got = await real(self, *args, **kwargs)
        answered[0] += 1
        if answered[0] == 20 and victim.process is not None:
            os.killpg(victim.process.pid, signal.SIGKILL)
            victim.process.wait()
        return got

    monkeypatch.setattr(vllm_features.FeatureClient, "capture", capture)
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "train", skip_preflight=True)
    assert victim.process is not None and victim.process.poll() is not None  # it really died mid-run
    assert_same_losses(losses(cfg), losses(offline_run))
    report = row["counts"]["stream"]
    assert any(victim.url in line for line in report["servers_out"]), report
    assert list(storage.iterdir()) == []

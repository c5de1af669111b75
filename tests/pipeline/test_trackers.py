"""train.report_to: every tracker holds the steps and values of train/metrics.jsonl, read back through its own store
(TensorBoard's event files, trackio's local store, an `mlflow server` on loopback through MLflow's client, wandb's
offline run files); a killed and resumed run continues the same tracker runs with no step twice and none missing;
a tracker whose server dies mid-run is one warning, and training finishes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from support.helpers import subprocess_env
from test_extract import prepared_run

from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.training.trackers import scalars

pytestmark = pytest.mark.slow  # trains drafters, starts an MLflow server

# trackio reads TRACKIO_DIR when imported: the libraries are imported only once the fixture has set the variables
MISSING = [name for name in ("tensorboard", "trackio", "wandb", "mlflow") if importlib.util.find_spec(name) is None]
if MISSING:
    pytest.skip(
        f"{', '.join(MISSING)} not installed: `bash scripts/setup.sh` installs the trackers", allow_module_level=True
    )

ALL = ["tensorboard", "trackio", "wandb", "mlflow"]
TRAIN = {"ttt": {"steps": 3}, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2, "eval_samples": 8, "log_every": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 with its own store, started and stopped by the test."""

    def __init__(self, folder: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).parent / "mlflow"
        self.log = folder / "server.log"
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "art")],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer in 120 s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, all started here
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def trackers_env(tmp_path_factory):
    """The trackers' local places (trackio's store, wandb offline) and a live MLflow server, for the module."""
    folder = tmp_path_factory.mktemp("trackers")
    server = MlflowServer(folder / "mlflow")
    env = {
        "TRACKIO_DIR": str(folder / "trackio"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": server.uri,
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def child_env(trackers_env: dict) -> dict:
    """A child run's environment: the trackers' places, and not this process's wandb service (wandb hands its
    service to its children through WANDB_SERVICE; a run of its own starts its own, as a user's would)."""
    env = subprocess_env() | trackers_env
    env.pop("WANDB_SERVICE", None)
    return env


def train(cfg) -> dict:
    with RunDir(cfg.run_dir).lock:
        return run_stage(cfg, "train")


def metrics(cfg) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()]


def run_of(identity: dict) -> dict:
    """What names a tracker run in train/trackers.json (without what it holds)."""
    return {k: v for k, v in identity.items() if k not in ("rows", "closed")}


def identities(cfg) -> dict:
    return json.loads((Path(cfg.run_dir) / "train" / "trackers.json").read_text())


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) list, as metrics.jsonl holds it."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in scalars(row).items():
            out.setdefault(key, []).append((row["step"], value))
    return out


# figures of the clock: a resumed run's steps past its checkpoint are trained again with the same losses but not in
# the same seconds, and a tracker that held them before the kill keeps the killed run's
TIMINGS = ("train/seconds", "train/tokens_per_s", "train/memory_gib")


def assert_same(logged: dict[str, list[tuple[int, float]]], rows: list[dict], tracker: str,
                ignore_values: tuple[str, ...] = ()) -> None:  # fmt: skip
    want = expected(rows)
    assert sorted(logged) == sorted(want), tracker
    for key, points in want.items():
        got = sorted(logged[key])
        assert [s for s, _ in got] == [s for s, _ in points], (tracker, key)  # each step once, none missing
        if key not in ignore_values:
            assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), (tracker, key)


# ------------------------------------------------------------------------------------------- readers


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def trackio_scalars(identity: dict) -> dict[str, list[tuple[int, float]]]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[str, list[tuple[int, float]]] = {}
    for log in SQLiteStorage.get_logs(identity["project"], identity["name"]):
        for key, value in log.items():
            if key.startswith(("train/", "eval/")):
                out.setdefault(key, []).append((log["step"], value))
    return out


def mlflow_scalars(identity: dict, keys) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(identity["tracking_uri"])
    run = client.get_run(identity["run_id"])
    assert set(run.data.metrics) == set(keys)
    return {key: [(m.step, m.value) for m in client.get_metric_history(identity["run_id"], key)] for key in keys}


def wandb_records(path: Path):
    """The records of a wandb run file (``run-ID.wandb``): W&B's log of 32 KiB blocks, each record a wandb
    ``Record`` protobuf split into chunks with a 7-byte header (CRC-32, length, type: full, first, middle, last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room  # zero padding to the block's end
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(folder: Path, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, dict]]:
    """The scalars of every offline segment of run ``run_id`` under ``folder`` (a resumed or reopened run adds a
    segment), and its logged tables (name: the table file wandb wrote)."""
    out: dict[str, list[tuple[int, float]]] = {}
    tables: dict[str, dict] = {}
    for path in sorted(folder.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            items: dict = {}
            for item in record.history.item:
                if item.key or len(item.nested_key) == 1:
                    items[item.key or item.nested_key[0]] = json.loads(item.value_json)
                else:  # a media value: its fields under its key
                    items.setdefault(item.nested_key[0], {})["/".join(item.nested_key[1:])] = json.loads(
                        item.value_json
                    )
            step = record.history.step.num if record.history.HasField("step") else items["_step"]
            for key, value in items.items():
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    tables[key] = json.loads((path.parent / "files" / value["path"]).read_text())
                elif key.startswith(("train/", "eval/")):
                    out.setdefault(key, []).append((step, value))
    return out, tables


# ------------------------------------------------------------------------------------------- one run, four readers


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target, trackers_env):
    """One short run that reports to all four trackers (6 steps, a line per step, held-out evaluations at 0, 3, 6),
    then evaluate (K=1, T=0, 2 prompts), whose τ table and plots go into the same tracker runs."""
    cfg = prepared_run(
        tmp_path_factory.mktemp("run"), tiny_target, n=32,
        train={**TRAIN, "max_steps": 6, "eval_every": 3, "save_every": 6, "report_to": ALL},
        evaluate={"num_samples": 2, "num_speculative_tokens": [1], "temperatures": [0.0], "max_new_tokens": 16},
    )  # fmt: skip
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train")
        run_stage(cfg, "evaluate")
    return cfg


def evaluated_tau(cfg) -> float:
    """The drafter's τ at K=1, T=0 in evaluate/report.json."""
    report = json.loads((Path(cfg.run_dir) / "evaluate" / "report.json").read_text())
    return next(r["tau"] for r in report["results"] if r["method"] == "eagle" and r["k"] == 1)


def test_tensorboard_event_files_hold_every_step_of_metrics_jsonl(trained):
    logged = tensorboard_scalars(Path(identities(trained)["tensorboard"]["dir"]))
    assert_same(logged, metrics(trained), "tensorboard")


def test_trackio_local_store_holds_every_step_and_the_run_config(trained):
    from trackio.sqlite_storage import SQLiteStorage

    identity = identities(trained)["trackio"]
    assert_same(trackio_scalars(identity), metrics(trained), "trackio")
    config = SQLiteStorage.get_run_config(identity["project"], identity["name"])
    assert config["config.train.lr"] == 1e-3 and config["resolved.family"] == trained.train.draft.family
    logs = SQLiteStorage.get_logs(identity["project"], identity["name"])
    tables = [log["evaluate/tau"] for log in logs if "evaluate/tau" in log]  # evaluate's table, in the same run
    assert len(tables) == 1 and str(evaluated_tau(trained)) in json.dumps(tables[0])
    assert any("evaluate/tau_vs_k" in log for log in logs)  # and its plots


def test_mlflow_server_holds_every_step_the_parameters_and_the_tables(trained):
    from mlflow.tracking import MlflowClient

    identity = identities(trained)["mlflow"]
    rows = metrics(trained)
    assert_same(mlflow_scalars(identity, expected(rows)), rows, "mlflow")
    client = MlflowClient(identity["tracking_uri"])
    run = client.get_run(identity["run_id"])
    assert json.loads(run.data.params["config.train.lr"]) == 1e-3
    assert json.loads(run.data.params["resolved.family"]) == trained.train.draft.family
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(identity["run_id"])} | {
        a.path for a in client.list_artifacts(identity["run_id"], "evaluate")
    }
    assert {"evaluate/tau.json", "evaluate/tau_vs_k.png", "evaluate/acceptance_by_position.png"} <= artifacts
    table = json.loads(Path(client.download_artifacts(identity["run_id"], "evaluate/tau.json")).read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert [r["tau"] for r in rows if r["method"] == "eagle" and r["k"] == 1] == [evaluated_tau(trained)]


def test_wandb_offline_run_files_hold_every_step(trained):
    identity = identities(trained)["wandb"]
    logged, tables = wandb_history(Path(identity["dir"]), identity["id"])
    assert_same(logged, metrics(trained), "wandb")
    table = tables["evaluate/tau"]  # evaluate's table, in the same run
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert [r["tau"] for r in rows if r["method"] == "eagle" and r["k"] == 1] == [evaluated_tau(trained)]


# ------------------------------------------------------------------------------------------- kill -9, resume

KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.training import loop

    write = loop.Metrics.write
    def write_then_die(self, row):
        write(self, row)
        if row["kind"] == "train" and row["step"] == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # a hard kill: no tracker is closed, nothing flushed
    loop.Metrics.write = write_then_die
    cfg = load_config(sys.argv[1])
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train")
""")


def wait_for_group_to_exit(pgid: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes of the killed run (group {pgid}) still run after {seconds} s")


def test_a_killed_run_resumes_the_same_tracker_runs_with_no_step_twice_and_none_missing(tmp_path, tiny_target,
                                                                                        trackers_env):  # fmt: skip
    cfg = prepared_run(
        tmp_path, tiny_target, n=32,
        train={**TRAIN, "max_steps": 7, "save_every": 3, "eval_every": 2, "report_to": ALL},
    )  # fmt: skip
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(config), "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(trackers_env),
        start_new_session=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    # wandb's own process (wandb-core) outlives a kill -9 of the run by a few seconds, writing the run's files:
    # pre-flight would rightly refuse to start beside it, so the test waits for it as a user would
    wait_for_group_to_exit(proc.pid)
    before = identities(cfg)
    assert before["mlflow"]["rows"] == len(metrics(cfg))  # every line written was handed on: 0, 1, 2, e2, 3, 4, e4, 5

    train(cfg)  # resumes from step 3: steps 4 and 5 are trained again
    after = identities(cfg)
    for name in ("trackio", "wandb", "mlflow"):  # the same tracker runs
        assert run_of(after[name]) == run_of(before[name]), name
    rows = metrics(cfg)
    assert [(r["kind"], r["step"]) for r in rows if r["kind"] == "train"] == [("train", s) for s in range(1, 8)]
    assert_same(tensorboard_scalars(Path(after["tensorboard"]["dir"])), rows, "tensorboard")  # purged, rewritten
    assert_same(trackio_scalars(after["trackio"]), rows, "trackio", TIMINGS)
    assert_same(mlflow_scalars(after["mlflow"], expected(rows)), rows, "mlflow", TIMINGS)
    logged, _ = wandb_history(Path(after["wandb"]["dir"]), after["wandb"]["id"])
    assert_same(logged, rows, "wandb", TIMINGS)


# ------------------------------------------------------------------------------------------- a tracker that dies

DYING_SERVER = textwrap.dedent("""
    import os, signal, sys
    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.training import loop

    write = loop.Metrics.write
    def write_then_kill_the_server(self, row):
        write(self, row)
        if row["kind"] == "train" and row["step"] == 2:
            os.killpg(int(sys.argv[2]), signal.SIGKILL)  # the MLflow server and its workers: gone mid-run
    loop.Metrics.write = write_then_kill_the_server
    cfg = load_config(sys.argv[1])
    with RunDir(cfg.run_dir).lock:
        print(run_stage(cfg, "train")["counts"]["steps"], "steps")
""")


def test_a_tracker_whose_server_dies_is_one_warning_and_training_finishes(tmp_path, tiny_target, trackers_env):
    server = MlflowServer(tmp_path / "mlflow")
    try:
        cfg = prepared_run(
            tmp_path, tiny_target, n=32,
            train={**TRAIN, "max_steps": 5, "eval_every": 5, "save_every": 5, "report_to": ["mlflow"]},
        )  # fmt: skip
        config = Path(cfg.run_dir) / "config.yaml"
        config.write_text(cfg.to_yaml())
        env = child_env(trackers_env) | {"MLFLOW_TRACKING_URI": server.uri, "COLUMNS": "400"}
        proc = subprocess.run(
            [sys.executable, "-c", DYING_SERVER, str(config), str(server.proc.pid)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
    finally:
        server.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "5 steps" in proc.stdout
    assert Counter(line.count("tracker mlflow failed") for line in out.splitlines())[1] == 1, out[-3000:]
    assert "Traceback" not in out
    assert [r["step"] for r in metrics(cfg) if r["kind"] == "train"] == [1, 2, 3, 4, 5]  # every step, still
    assert identities(cfg)["mlflow"]["rows"] == 3  # e0, 1, 2: what reached the server before it died


# ------------------------------------------------------------------------------------------- pre-flight


def test_preflight_names_what_a_tracker_lacks_and_never_shows_a_credential(trackers_env, monkeypatch, tmp_path):
    from types import SimpleNamespace

    from eaglekit.preflight.trackers import trackers as check

    def results(report_to) -> list:
        return check(SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(report_to=report_to))))  # type: ignore[arg-type]

    assert [r.status for r in results(ALL)] == ["ok"] * 4  # offline wandb, local trackio, the live MLflow server
    assert results([])[0].status == "skip"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    gone = results(["mlflow"])[0]
    assert gone.status == "fail" and "does not answer" in gone.detail and "mlflow server" in gone.remedy

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc either
    missing = results(["wandb"])[0]
    assert missing.status == "fail" and "WANDB_API_KEY is not set" in missing.detail

    secret = "wandb-key-that-must-not-be-printed"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    unreachable = results(["wandb"])[0]
    assert unreachable.status == "fail" and "does not answer" in unreachable.detail
    monkeypatch.setenv("WANDB_BASE_URL", trackers_env["MLFLOW_TRACKING_URI"])  # a server that answers
    present = results(["wandb"])[0]
    assert present.status == "ok" and "WANDB_API_KEY" in present.detail
    for r in (unreachable, present):
        assert secret not in r.detail + r.remedy


def test_verify_adds_its_served_table_to_the_demos_tensorboard_run(demo_run):
    """The demo (report_to unset: TensorBoard, installed) trains, then verify serves its drafter in vLLM's CPU build
    and adds its served-vs-offline table to the tracker run training logged to: the text holds verify's own τ."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = demo_run[0]
    report_path = run_dir / "verify" / "report.json"
    if not report_path.exists():
        pytest.skip("the demo ran without verify (no .venv-vllm)")
    folder = json.loads((run_dir / "train" / "trackers.json").read_text())["tensorboard"]["dir"]
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("verify/served_vs_offline"))
    text = acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
    for served in json.loads(report_path.read_text())["runs"]:
        assert f"| {served['form']} | {served['k']} | vllm | {served['tau']['served']} |" in text, (served, text)

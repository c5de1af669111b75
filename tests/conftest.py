"""Shared fixtures: the built-in tiny target (built once per machine, cached) and an in-process CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Tests use tiny models: intra-op threads only add overhead there (and contention on a 2-core runner). The
# processes they start inherit it: an `eaglekit run` child left on torch's default takes both cores, and two of
# them, one per test worker, took 277 s for a block drafter's 120 training steps that take 116 s on one thread.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))  # the tests import their helpers as the package `support`
# some test modules still import fixtures and builders from others by name (test_extract's prepared_run, …), as
# they did in one flat folder; each group's folder on the path keeps those names
sys.path[1:1] = [
    str(group)
    for group in sorted(Path(__file__).parent.iterdir())
    if group.is_dir() and group.name != "support" and not group.name.startswith((".", "_"))
]

from support.helpers import FEATURE_LAYERS, SESSION_ENVIRON, subprocess_env  # noqa: E402  (after the path it is found on)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    from eaglekit.tiny import ensure_tiny_target

    return ensure_tiny_target()


_tiny_target_build: subprocess.Popen | None = None


# The files that take longest on 2 cores (--durations; their fixtures train drafters, run the demo or start vLLM),
# longest first, so that no worker ends alone on one while the other idles. test_verify.py and test_suites_verify.py
# read the run test_demo.py makes: they come after other long files, by when that run is done.
LONG_FILES = (
    "test_families.py",  # ~640 s: a block drafter trained per family in-process and by `eaglekit run`
    "test_demo.py",  # ~510 s: the shared demo run, then the offline demo
    "test_vllm_mla.py",  # ~210 s
    "test_verify.py",  # ~260 s: three verify runs in vLLM
    "test_peagle.py",  # `eaglekit run` of a P-EAGLE drafter, both forms served in vLLM
    "test_watch.py",  # one vLLM start serving the demo drafter
    "test_publish.py",  # reads the demo run
    "test_incremental_data.py",
    "test_checkpoint_integrity.py",
    "test_disk_full.py",
    "test_suites_verify.py",
    "test_dflash.py",
    "test_dspark.py",
    "test_train.py",
    "test_trackers.py",  # one run into four trackers, a kill -9 resume, an MLflow server killed mid-run
    "test_finetune.py",
    "test_train_ddp.py",
    "test_extract.py",
    "test_extract_vllm.py",
    "test_mla_run.py",
    "test_vllm_engine.py",
    "test_capture_check_vllm.py",
)


# Every xdist worker must collect the same order, so whether the tiny target still has to be built is decided once,
# before the workers start (they inherit the environment), not by each worker looking at the cache a moment apart.
TINY_TARGET_PENDING = "EAGLEKIT_TESTS_TINY_TARGET_PENDING"


def pytest_configure(config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller, or a run without workers
        from eaglekit.tiny.build import cached_target_dir, is_built

        os.environ[TINY_TARGET_PENDING] = "0" if is_built(cached_target_dir()) else "1"


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items) -> None:
    """The order the files go to the xdist workers in (scripts/check.sh passes --no-loadscope-reorder; xdist's
    default sends the files with most tests first, which left the long files of few tests for last): LONG_FILES
    first, longest first, then the others with most tests first. Each file keeps its own order (whole files go to
    one worker). Where the tiny target is not built yet, its files go last and its first build (5-15 minutes on
    one core) starts at once in a process of its own: the other tests fill the second core meanwhile, where
    otherwise every worker would wait on the build's lock."""
    global _tiny_target_build
    needs = {item.path for item in items if "tiny_target" in getattr(item, "fixturenames", ())}
    building = bool(needs) and os.environ[TINY_TARGET_PENDING] == "1"
    counts = Counter(item.path for item in items)

    def rank(item) -> tuple[bool, int, int]:
        name = item.path.name
        long_rank = LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)
        return (building and item.path in needs, long_rank, -counts[item.path])

    items.sort(key=rank)
    first_process = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"  # one build for all workers
    if building and first_process:
        # ensure_tiny_target's lock makes the tests that need the target wait for this build, not start their own
        _tiny_target_build = subprocess.Popen(
            [sys.executable, "-c", "from eaglekit.tiny import ensure_tiny_target; ensure_tiny_target()"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def pytest_unconfigure(config) -> None:
    """A run that stops early (-x, Ctrl-C) leaves no build behind; its lock goes with it, and the next caller of
    ensure_tiny_target builds from scratch (atomic_dir only ever renames in whole builds)."""
    if _tiny_target_build is not None and _tiny_target_build.poll() is None:
        _tiny_target_build.terminate()
        _tiny_target_build.wait()


@pytest.fixture(scope="session")
def tiny_deepseek_target(tmp_path_factory) -> Path:
    """A DeepSeek-V3-shaped tiny target (MLA + 4 routed experts) on the tiny target's tokenizer and corpus, trained
    for 300 steps from seed 0 (~30 s): its replies are mostly well formed, which is all a drafter needs to learn."""
    from eaglekit.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("deepseek") / "target", steps=300, heldout=0, arch="deepseek_v3")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the real vLLM environment (scripts/setup_vllm.sh makes .venv-vllm).

    Missing, the test fails: CI must run the real-engine tests, never pass by skipping them. A developer
    without the venv can set EAGLEKIT_SKIP_VLLM=1 to skip them knowingly.
    """
    from eaglekit.errors import UsageError
    from eaglekit.serving.engine import find_vllm_python

    try:
        return find_vllm_python()
    except UsageError as err:
        if os.environ.get("EAGLEKIT_SKIP_VLLM") == "1":
            pytest.skip(f"real vLLM not installed and EAGLEKIT_SKIP_VLLM=1: {err.message}")
        pytest.fail(
            f"the real-engine tests need vLLM: {err.message}; {err.remedy} "
            "(or set EAGLEKIT_SKIP_VLLM=1 to skip them on purpose)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def feature_servers(vllm_python, tiny_target, tmp_path_factory):
    """``feature_servers(n)``: (n real vLLM feature servers of the tiny target, the storage folder they share),
    capturing FEATURE_LAYERS through eaglekit's CPU connector in float32. The servers are started as tests first
    ask for them and kept for the session, so the extract tests (one server) and the stream tests (two) run on
    the same engines: two starts, not three, where one process runs both files. A server a test killed is
    replaced by a fresh one when asked for again."""
    from eaglekit.serving.engine import VllmServer
    from eaglekit.serving.vllm_features import plugin_dir, serve_args

    root = tmp_path_factory.mktemp("feature-servers")
    storage = root / "hidden-states"
    storage.mkdir()
    args = ["--max-model-len", "1024", *serve_args(FEATURE_LAYERS, str(storage), "cpu")]
    servers: list[VllmServer] = []
    starts = 0

    def ask(count: int) -> tuple[list[VllmServer], Path]:
        nonlocal starts
        fresh = []
        for k in range(count):
            if k < len(servers) and servers[k].process is not None and servers[k].process.poll() is None:
                continue
            log = root / f"vllm-{starts}.log"
            server = VllmServer(vllm_python, str(tiny_target), args, log, env={"PYTHONPATH": str(plugin_dir())})
            servers[k : k + 1] = [server]
            fresh.append(server.start())
            starts += 1
        for server in fresh:  # started together, waited for together: the engines load side by side
            server.wait_ready()
        return servers[:count], storage

    try:
        yield ask
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, tiny_target):
    """`eaglekit demo` run once per test session: (run dir, its --json document, its stderr). With the vLLM venv
    present the demo ends with `verify` in the real engine. Shared by the demo and verify tests, across pytest-xdist
    workers too (the run takes minutes): the first worker to need it runs it under a lock in the folder the workers
    share, the others wait for it and read the same run."""
    import fcntl
    import json

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-N/, above each worker's popen-gwK/
    run_dir, saved = shared / "demo" / "run", shared / "demo" / "result.json"
    run_dir.parent.mkdir(exist_ok=True)
    with open(shared / "demo.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            proc = subprocess.run(
                [sys.executable, "-m", "eaglekit.cli", "demo", "--run-dir", str(run_dir), "--json"],
                capture_output=True,
                text=True,
                timeout=2400,
                # the session's starting environment: the demo is shared by every test that asks for it, whichever
                # asks first, so no module's variables (test_trackers' tracker places) may decide how it runs
                env=subprocess_env(SESSION_ENVIRON),
            )
            assert proc.returncode == 0, proc.stderr[-5000:]
            saved.write_text(json.dumps({"stdout": proc.stdout, "stderr": proc.stderr}))
    result = json.loads(saved.read_text())
    return run_dir, json.loads(result["stdout"]), result["stderr"]


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """Run `eaglekit ARGS` in this process; returns exit code, stdout and stderr."""
    from eaglekit.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run

"""Helpers the tests import: the repository's root, writing a config, a child process's environment, a real
tmpfs to fill a disk with."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FEATURE_LAYERS = [2, 4, 5, 8]  # the tiny target's default aux taps and its final state (8 decoder layers)


def write_config(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# the environment the test session started in, before any fixture set a variable of its own in it
SESSION_ENVIRON = dict(os.environ)


def subprocess_env(base: dict | None = None) -> dict:
    """A child process's environment: ``base`` (default: this process's now) with the repository's source first
    on its path and torch on one thread."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str, inodes: int = 10_000):
    """A real tmpfs of ``size`` mounted at ``path`` to fill a disk for real; skips, saying why, where it cannot be
    mounted (it needs root: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill a disk for real needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def run_in_vllm(vllm_python: Path, script: str, *args: object, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` run by the vLLM venv's python (``-c``) on the CPU build's settings, offline, in ``cwd``; it must
    exit 0 (its stderr's tail otherwise)."""
    from eaglekit.serving.engine import cpu_environment

    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **cpu_environment(vllm_python)}
    probe = subprocess.run(
        [str(vllm_python), "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=cwd,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    return probe

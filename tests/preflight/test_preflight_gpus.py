"""GPU checks against a fake NVML (tests/support/fake_nvml.py): 8 GPUs, one nearly empty, a foreign process, an ECC error.

On this machine there is no NVIDIA driver, so the real pynvml is also exercised: it must skip, saying why.
"""

from __future__ import annotations

import json
import sys

import pytest
from support.fake_nvml import GB, fake_pynvml, gpu

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.preflight import gpus as G


def make_ctx(tmp_path, target, stage="extract", **sections):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    data = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target)},
        "data": {"prompts": str(tmp_path / "p.jsonl")},
        "extract": {"mode": "offline"},
        **sections,
    }
    return pipeline.make_context(parse_config(data, base_dir=tmp_path), stage)


@pytest.fixture
def nvml(monkeypatch):
    def install(gpus=None, init_error=None):
        fake = fake_pynvml(gpus, init_error)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


def by_name(results):
    return {r.name: r for r in results}


def test_without_a_driver_every_gpu_check_skips_saying_why(tmp_path, tiny_target, nvml):
    nvml(init_error=9)
    [r] = G.gpus(make_ctx(tmp_path, tiny_target))
    assert r.status == "skip" and "Driver Not Loaded" in r.detail


def test_the_real_nvml_on_this_machine_skips_or_lists_every_gpu(tmp_path, tiny_target, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    results = G.gpus(make_ctx(tmp_path, tiny_target))
    found = G.inventory()
    if isinstance(found, str):
        assert [r.status for r in results] == ["skip"] and results[0].detail == found
    else:
        assert results[0].name == "GPUs" and all(g.uuid in results[0].detail for g in found)


def test_eight_healthy_gpus_raise_no_alarm(tmp_path, tiny_target, nvml):
    fake = nvml([gpu(i, used=0.5) for i in range(8)])
    results = G.gpus(make_ctx(tmp_path, tiny_target))
    assert {r.status for r in results} == {"ok"}, [(r.name, r.detail) for r in results]
    listing = by_name(results)["GPUs"].detail
    assert all(f"GPU {i} NVIDIA H200 GPU-{i:08x}-fake" in listing for i in range(8))
    assert "GPU free memory" in by_name(results)
    assert fake.calls == ["init", "shutdown"]


def test_a_server_sharded_over_eight_gpus_with_uniform_memory_is_fine(tmp_path, tiny_target, nvml):
    nvml([gpu(i, used=120 + i * 0.1, processes=[(4_000_000 + i, 119 * GB)]) for i in range(8)])
    ctx = make_ctx(
        tmp_path,
        tiny_target,
        stage="generate",
        generate={"backend": "openai", "servers": ["http://127.0.0.1:9/v1"], "model": "m"},
    )
    assert {r.status for r in G.gpus(ctx)} == {"ok"}  # the server's own processes are expected on its GPUs


def test_one_of_eight_gpus_nearly_empty_is_a_warning_naming_it(tmp_path, tiny_target, nvml):
    nvml([gpu(i, used=0.6 if i == 5 else 120) for i in range(8)])
    spread = by_name(G.gpus(make_ctx(tmp_path, tiny_target)))["GPU memory spread"]
    assert spread.status == "warn" and "GPU 5 (600.0 MB)" in spread.detail and "GPU 4" not in spread.detail


def test_a_foreign_process_on_the_stages_gpus_is_listed_with_its_pid(tmp_path, tiny_target, nvml):
    nvml([gpu(i, used=0.5, processes=[(4_000_123, 30 * GB)] if i == 2 else []) for i in range(8)])
    results = by_name(G.gpus(make_ctx(tmp_path, tiny_target)))
    assert (
        "GPU 2 NVIDIA H200 GPU-00000002-fake: 500.0 MB of 141.0 GB used, 90% busy, 0 uncorrected ECC, pids 4000123 "
        "(other namespace)" in results["GPUs"].detail
    )
    procs = results["GPU processes"]
    assert procs.status == "warn"
    assert "GPU 2: pid 4000123 (not in this PID namespace" in procs.detail and "30.0 GB" in procs.detail


def test_an_uncorrected_ecc_error_fails_naming_the_gpu(tmp_path, tiny_target, nvml):
    nvml([gpu(i, used=0.5, ecc=2 if i == 3 else 0) for i in range(8)])
    bad = [r for r in G.gpus(make_ctx(tmp_path, tiny_target)) if r.status == "fail"]
    assert [r.name for r in bad] == ["GPU 3 memory"]
    assert "2 uncorrected ECC" in bad[0].detail and "GPU-00000003-fake" in bad[0].detail


def test_pending_row_remapping_warns_and_unsupported_queries_are_not_errors(tmp_path, tiny_target, nvml):
    nvml([gpu(0, used=0.5, remap=(1, 0, 1, 0)), gpu(1, used=0.5, ecc=None, remap=None)])
    results = by_name(G.gpus(make_ctx(tmp_path, tiny_target)))
    assert results["GPU 0 memory"].status == "warn" and "remapped rows" in results["GPU 0 memory"].detail
    assert "GPU 1 memory" not in results


def test_too_little_free_memory_for_the_target_fails(tmp_path, tiny_target, nvml):
    full = 141 - 0.001  # 1 MB free; the tiny target needs ~6 MB with headroom
    nvml([gpu(i, used=full) for i in range(2)])
    free = by_name(G.gpus(make_ctx(tmp_path, tiny_target)))["GPU free memory"]
    assert free.status == "fail" and "GPU 0 has 1.0 MB" in free.detail and "GPU 1 has 1.0 MB" in free.detail


def test_only_the_visible_gpus_need_free_memory(tmp_path, tiny_target, nvml, monkeypatch):
    nvml([gpu(0, used=141 - 0.001), gpu(1, used=0.5)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001")  # a UUID prefix, as CUDA accepts
    results = by_name(G.gpus(make_ctx(tmp_path, tiny_target)))
    assert results["GPU free memory"].status == "ok" and "1 visible" in results["GPUs"].detail

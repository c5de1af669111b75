"""Software and devices: the target's architecture known to transformers (or its own code allowed and present),
a CPU torch on a machine with GPUs, torchrun asking for more processes than GPUs, a target too big for the RAM."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from support.fake_nvml import fake_pynvml, gpu

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.preflight import environment


def ctx_for(tmp_path, target, stage="extract", **target_keys):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    data = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target), **target_keys},
        "data": {"prompts": str(tmp_path / "p.jsonl")},
    }
    return pipeline.make_context(parse_config(data, base_dir=tmp_path), stage)


def custom_target(tmp_path, tiny_target, model_type="kimi_x", auto_map=True, with_code=True):
    t = tmp_path / "custom"
    shutil.copytree(tiny_target, t)
    config = json.loads((t / "config.json").read_text())
    config["model_type"] = model_type
    if auto_map:
        config["auto_map"] = {
            "AutoConfig": "configuration_kimi.KimiConfig",
            "AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM",
        }
    (t / "config.json").write_text(json.dumps(config))
    if with_code:
        (t / "configuration_kimi.py").write_text("# stand-in\n")
        (t / "modeling_kimi.py").write_text("# stand-in\n")
    return t


def test_software_lists_versions_and_knows_the_tiny_targets_architecture(tmp_path, tiny_target):
    result = environment.software(ctx_for(tmp_path, tiny_target))
    assert result.status == "ok" and "torch " in result.detail and "model_type `llama` known" in result.detail


def test_an_architecture_unknown_to_transformers_fails(tmp_path, tiny_target):
    result = environment.software(ctx_for(tmp_path, custom_target(tmp_path, tiny_target, auto_map=False)))
    assert result.status == "fail" and "does not know model_type `kimi_x`" in result.detail


def test_remote_code_must_be_allowed_and_present(tmp_path, tiny_target):
    t = custom_target(tmp_path, tiny_target)
    refused = environment.software(ctx_for(tmp_path, t))
    assert refused.status == "fail" and "trust_remote_code: true" in refused.remedy
    assert environment.software(ctx_for(tmp_path, t, trust_remote_code=True)).status == "ok"
    (t / "modeling_kimi.py").unlink()
    absent = environment.software(ctx_for(tmp_path, t, trust_remote_code=True))
    assert absent.status == "fail" and "modeling_kimi.py" in absent.detail


@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def test_a_cpu_machine_with_a_small_target_is_fine(tmp_path, tiny_target, no_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=12))
    result = environment.devices(ctx_for(tmp_path, tiny_target))
    assert result.status == "ok" and "runs on the CPU" in result.detail


def test_a_target_larger_than_the_free_memory_fails_without_cuda(tmp_path, tiny_target, no_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=12))
    monkeypatch.setattr(environment, "_free_memory", lambda: 1_000_000)
    result = environment.devices(ctx_for(tmp_path, tiny_target))
    assert result.status == "fail" and "exceed the 1.0 MB of free memory" in result.detail


def test_a_cpu_torch_on_a_machine_with_gpus_is_caught(tmp_path, tiny_target, no_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([gpu(i, used=0.5) for i in range(8)]))
    small = environment.devices(ctx_for(tmp_path, tiny_target))
    assert small.status == "warn" and "driver reports 8 GPU(s)" in small.detail and "CUDA build" in small.remedy
    monkeypatch.setattr(environment, "_free_memory", lambda: 1_000_000)  # a target that cannot run on the CPU
    assert environment.devices(ctx_for(tmp_path, tiny_target)).status == "fail"


def test_torchrun_without_cuda_is_a_warning(tmp_path, tiny_target, no_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=12))
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = environment.devices(ctx_for(tmp_path, tiny_target))
    assert result.status == "warn" and "2 processes" in result.detail


def test_torchrun_with_more_processes_than_gpus_fails(tmp_path, tiny_target, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([gpu(i, used=0.5) for i in range(4)]))
    result = environment.devices(ctx_for(tmp_path, tiny_target))
    assert result.status == "fail" and "8 processes on this node but torch sees 4" in result.detail
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert environment.devices(ctx_for(tmp_path, tiny_target)).status == "ok"

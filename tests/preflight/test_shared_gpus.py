"""Streamed features on shared GPUs and the spool's room: the vLLM servers' gpu_memory_utilization beside the
drafter's step memory (plan, train's pre-flight against a fake NVML, serve-command), and the spool sized in the dtype
the servers write."""

from __future__ import annotations

import json
import sys

import pytest
from support.fake_nvml import fake_pynvml, gpu
from support.helpers import write_config

from eaglekit import pipeline
from eaglekit.config import load_config
from eaglekit.data.tokens import write_token_store
from eaglekit.preflight import feature_servers, shared_gpus
from eaglekit.stages import train as train_stage


@pytest.fixture
def nvml(monkeypatch):
    def install(gpus=None, init_error=None):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, init_error))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


def stream_config(tmp_path, target, *, longest=None, **vllm):
    """A streamed run of ``target`` (its prepared tokens: one sample of ``longest`` tokens, when given)."""
    storage = tmp_path / "hidden-states"
    storage.mkdir(exist_ok=True)
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    spool_gb = vllm.pop("spool_gb", 4.0)
    train = vllm.pop("train", {})
    data = {
        "run_dir": "run",
        "target": {"model": str(target)},
        "data": {"prompts": "p.jsonl"},
        "prepare": {"max_length": 512},
        "vocab": {"draft_vocab_size": 200},
        "train": {"batch_size": 4, **train},
        "extract": {
            "mode": "stream",
            "backend": "vllm",
            "stream": {"spool_gb": spool_gb},
            "vllm": {"servers": ["http://127.0.0.1:9/v1"], "storage_path": str(storage), **vllm},
        },
    }
    cfg = load_config(write_config(tmp_path / "cfg.yaml", data))
    if longest:
        prepared = tmp_path / "run" / "prepare"
        prepared.mkdir(parents=True, exist_ok=True)
        write_token_store(prepared / "tokens.safetensors", [("long", [5] * longest, [1] * longest)])
    return cfg


def target_in(tmp_path, tiny_target, dtype: str):
    """The tiny target's config.json with another dtype (what the servers serve it in): all the checks read."""
    folder = tmp_path / f"target-{dtype}"
    folder.mkdir()
    config = json.loads((tiny_target / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    return folder


# ------------------------------------------------------------------------------------------------ the spool


def test_a_spool_sized_for_the_servers_bf16_files_passes_and_one_too_small_names_the_size(tmp_path, tiny_target):
    # the tiny target: 4 captured states of 128 a token; 1,000 tokens are 1.03 MB in bf16, 2.06 MB in float32
    bf16 = target_in(tmp_path, tiny_target, "bfloat16")
    cfg = stream_config(tmp_path, bf16, longest=1000, spool_gb=0.0015)
    result = feature_servers.spool_room(pipeline.make_context(cfg, "train"))
    assert result.status == "ok", result.detail  # refused before: it counted 4 bytes a value
    assert "file is 1.0 MB (bfloat16 states)" in result.detail

    fp32 = target_in(tmp_path, tiny_target, "float32")
    cfg = stream_config(tmp_path, fp32, longest=1000, spool_gb=0.0015)
    result = feature_servers.spool_room(pipeline.make_context(cfg, "train"))
    assert result.status == "fail" and "file of 2.1 MB (float32)" in result.detail
    assert "spool_gb to at least 0.00227" in result.remedy


# -------------------------------------------------------------------------------------- GPUs shared with vLLM


def step_bytes(cfg) -> int:
    plain, recomputed = train_stage.step_memory_both(cfg)
    return (recomputed if cfg.train.ttt.activation_checkpointing else plain).total


def test_servers_beside_the_trainer_are_refused_where_both_do_not_fit_and_the_named_share_fits(
    tmp_path, tiny_target, nvml
):
    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True)
    step = step_bytes(cfg)
    total = 4 * step  # vLLM's default 0.92 leaves 0.32 steps; 0.75 leaves exactly one
    nvml([gpu(i, used=0, total=total / 1e9) for i in range(8)])
    assert train_stage.shared_gpu_memory in train_stage.checks(cfg)

    refused = train_stage.shared_gpu_memory(pipeline.make_context(cfg, "train"))
    assert refused.status == "fail", refused.detail
    assert "0.92 ×" in refused.detail and "vLLM's default" in refused.detail and "does not fit" in refused.detail
    assert "extract.vllm.gpu_memory_utilization: 0.75" in refused.remedy
    assert "train.ttt.activation_checkpointing: true" not in refused.remedy  # it would not fit at 0.92 either
    assert "train.batch_size" in refused.remedy and "shares_trainer_gpus: false" in refused.remedy

    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.75)
    fits = train_stage.shared_gpu_memory(pipeline.make_context(cfg, "train"))
    assert fits.status == "ok", fits.detail
    assert fits.detail.startswith("GPU 0 (") and "(the smallest of 8 GPUs)" in fits.detail and "0.75 ×" in fits.detail

    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.76)
    assert train_stage.shared_gpu_memory(pipeline.make_context(cfg, "train")).status == "fail"


def test_activation_checkpointing_is_named_when_it_makes_room(tmp_path, tiny_target, nvml):
    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.5)
    plain, recomputed = train_stage.step_memory_both(cfg)
    assert recomputed.total < plain.total
    total = plain.total + recomputed.total  # half of it: between the checkpointed step and the plain one
    nvml([gpu(0, used=0, total=total / 1e9)])
    refused = train_stage.shared_gpu_memory(pipeline.make_context(cfg, "train"))
    assert refused.status == "fail" and "train.ttt.activation_checkpointing: true" in refused.remedy


def test_on_a_machine_without_gpus_the_check_skips_and_servers_on_their_own_gpus_are_not_checked(
    tmp_path, tiny_target, nvml
):
    nvml(init_error=9)
    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.5)
    skipped = train_stage.shared_gpu_memory(pipeline.make_context(cfg, "train"))
    assert skipped.status == "skip" and "Driver Not Loaded" in skipped.detail
    apart = stream_config(tmp_path, tiny_target, gpu_memory_utilization=0.5)
    assert train_stage.shared_gpu_memory not in train_stage.checks(apart)


def plan_train_lines(cli, tmp_path) -> list[str]:
    r = cli("plan", tmp_path / "cfg.yaml", "--samples", "100", "--mean-tokens", "400", "--free-bytes", "1TB", "--json")
    doc = json.loads(r.out)
    return next(s for s in doc["stages"] if s["stage"] == "train")["how"]


def test_plan_prints_the_servers_share_and_the_step_per_gpu_or_the_gpu_both_need(tmp_path, tiny_target, cli, nvml):
    cfg = stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.75)
    step = step_bytes(cfg)
    nvml([gpu(0, used=0, total=4 * step / 1e9), gpu(1, used=0, total=3 * step / 1e9)])
    how = plan_train_lines(cli, tmp_path)
    assert any("the servers 0.75 (extract.vllm.gpu_memory_utilization)" in line for line in how), how
    gpu0 = next(line for line in how if line.strip().startswith("GPU 0 ("))
    gpu1 = next(line for line in how if line.strip().startswith("GPU 1 ("))
    assert gpu0.endswith(": fits") and gpu1.endswith(": does not fit")

    nvml(init_error=9)
    how = plan_train_lines(cli, tmp_path)
    from eaglekit.progress import human_bytes

    assert any(f"both fit a GPU of {human_bytes(4 * step)} or more" in line for line in how), how


def test_serve_command_prints_the_configured_gpu_memory_utilization(tmp_path, tiny_target, cli):
    stream_config(tmp_path, tiny_target, shares_trainer_gpus=True, gpu_memory_utilization=0.55)
    r = cli("serve-command", tmp_path / "cfg.yaml")
    assert r.code == 0 and "--gpu-memory-utilization 0.55" in r.out
    stream_config(tmp_path, tiny_target)
    assert "--gpu-memory-utilization" not in cli("serve-command", tmp_path / "cfg.yaml").out


def test_the_share_that_leaves_the_step_is_the_largest_that_fits():
    for step, total in [(10, 80), (79, 80), (1, 3), (24_000_000_000, 141_000_000_000)]:
        share = shared_gpus.utilization_leaving(step, total)
        assert share * total + step <= total < (share + 0.01) * total + step


def test_a_gpu_memory_utilization_past_1_is_refused_as_vllm_refuses_it(tmp_path, tiny_target):
    from eaglekit.errors import EaglekitError

    with pytest.raises(EaglekitError, match=r"gpu_memory_utilization': Input should be less than or equal to 1"):
        stream_config(tmp_path, tiny_target, gpu_memory_utilization=1.5)


def test_sharing_the_trainers_gpus_outside_stream_mode_is_refused_not_ignored(tmp_path, tiny_target):
    from eaglekit.errors import UsageError

    data = {
        "run_dir": "run",
        "target": {"model": str(tiny_target)},
        "data": {"prompts": "p.jsonl"},
        "extract": {
            "mode": "offline",
            "backend": "vllm",
            "vllm": {"servers": ["http://127.0.0.1:9/v1"], "storage_path": str(tmp_path), "shares_trainer_gpus": True},
        },
    }
    with pytest.raises(UsageError, match=r"shares_trainer_gpus is set but extract.mode is 'offline'") as caught:
        load_config(write_config(tmp_path / "cfg.yaml", data))
    assert "extract.mode: stream" in caught.value.remedy

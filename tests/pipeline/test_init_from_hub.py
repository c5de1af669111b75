"""train.init_from as a hub id: downloaded by the train stage's pre-flight from a stand-in hub on 127.0.0.1
(``HF_ENDPOINT``), resumed after a failure from the byte it stopped at, checked like a local drafter, then used
for training from the cache with the hub gone."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file
from support.local_hub import LocalHub
from test_extract import prepared_run

from eaglekit import pipeline
from eaglekit.drafters.eagle3.checkpoint import save_legacy
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.errors import UsageError
from eaglekit.hub import drafter_folder
from eaglekit.model.target import target_hf_config
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir
from eaglekit.stages.train import params

pytestmark = pytest.mark.slow  # builds, trains or serves models

REPO = "AQ-MedAI/tiny-eagle3"
CHUNK = 64 << 10


@pytest.fixture
def published(tmp_path, tiny_target) -> Path:
    """A drafter for the tiny target laid out as the AQ-MedAI Kimi-K2 one is: bf16 weights without the embedding,
    SGLang's aux ids only, a README, and the optimizer state beside it (which must not be downloaded)."""
    from eaglekit.config import TargetConfig

    hf = target_hf_config(TargetConfig(model=str(tiny_target)))
    torch.manual_seed(3)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(hf, draft_vocab_size=hf.vocab_size)).to(torch.bfloat16)
    folder = tmp_path / "published"
    save_legacy(drafter, folder, include_embeddings=False)
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "README.md").write_text("# tiny EAGLE-3\n")
    torch.save({"optimizer": torch.zeros(1000)}, folder / "training_state.pt")
    assert (folder / "model.safetensors").stat().st_size > 3 * CHUNK
    return folder


def preflight(cfg) -> dict:
    return {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "train"))}


def test_hub_drafter_is_fetched_by_preflight_resumed_and_trained_from(tmp_path, tiny_target, published, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # the client writes what it has received in chunks of this size: small, so a cut-short file keeps some
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    cfg = prepared_run(
        tmp_path,
        tiny_target,
        n=40,
        train={
            "init_from": REPO,
            "ttt": {"steps": 2},
            "batch_size": 4,
            "max_steps": 2,
            "eval_every": 2,
            "save_every": 2,
            "eval_samples": 4,
        },
    )
    assert cfg.train.init_from == REPO  # a hub id stays one; the fingerprint names it without fetching it
    assert params(ResolvedRun(cfg))["init_from"] == {"hub": REPO}

    weights = published / "model.safetensors"
    with LocalHub({REPO: published}, cut={"model.safetensors": 3 * CHUNK + 1000}, refuse_ranges=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        # The hub fails half-way through the weights: pre-flight fails, naming the remedy, and keeps the bytes.
        checks = preflight(cfg)
        check = checks["init_from download"]
        assert check.status == "fail" and "download failed" in check.detail and "rerun" in check.remedy
        assert checks["init_from files"].status == checks["init_from"].status == "skip"  # nothing to read yet
        partial = list((tmp_path / "hf" / "hub").rglob("*.part"))
        assert [p.stat().st_size for p in partial] == [3 * CHUNK]
        assert hub.gets("model.safetensors") == [None, f"bytes={3 * CHUNK}-"]  # the client's own retry was refused

        # Back up: the rerun asks only for the rest, then checks the drafter like a local one.
        hub.refuse_ranges = False
        checks = preflight(cfg)
        assert checks["init_from download"].status == "ok" and "downloaded into" in checks["init_from download"].detail
        assert checks["init_from files"].status == "ok", checks["init_from files"]  # headers read from the cache
        check = checks["init_from"]
        assert check.status == "ok", check
        assert "cached in" in check.detail and "fits the target" in check.detail
        rerun = hub.gets("model.safetensors")[2:]  # each response is cut short again: the client keeps resuming
        assert rerun[0] == f"bytes={3 * CHUNK}-" and len(rerun) >= 2
        assert [int(r[6:-1]) for r in rerun] == sorted({int(r[6:-1]) for r in rerun})  # never from the start
        assert not hub.gets("training_state.pt") and not hub.gets("README.md")
        asked = len(hub.requests)  # once cached, a later pre-flight does not ask the hub again
        assert "is in the Hugging Face cache" in preflight(cfg)["init_from download"].detail
        assert len(hub.requests) == asked
    snapshot = next((tmp_path / "hf" / "hub").glob("models--AQ-MedAI--tiny-eagle3/snapshots/*"))
    assert (
        hashlib.sha256((snapshot / "model.safetensors").read_bytes()).digest()
        == hashlib.sha256(weights.read_bytes()).digest()
    )
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors"]
    assert not list((tmp_path / "hf" / "hub").rglob("*.part"))

    # The hub is gone: training reads the cache.
    with RunDir(cfg.run_dir).lock:
        row = pipeline.run_stage(cfg, "train", skip_preflight=True)
    assert row["counts"]["steps"] == 2 and row["counts"]["draft_vocab"] == "init_from checkpoint"
    best = load_file(str(Path(cfg.run_dir) / "train" / "checkpoints" / "best" / "model.safetensors"))
    assert set(best) >= set(load_file(str(weights)))


def test_an_unknown_hub_id_fails_preflight_by_name(tmp_path, tiny_target, published, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = prepared_run(tmp_path, tiny_target, n=24, train={"init_from": "AQ-MedAI/no-such-drafter"})
    with LocalHub({REPO: published}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        check = preflight(cfg)["init_from download"]
    assert check.status == "fail" and "no repository AQ-MedAI/no-such-drafter" in check.detail
    assert "HF_TOKEN" in check.remedy
    with pytest.raises(UsageError, match="not in the Hugging Face cache"):  # what training says without pre-flight
        drafter_folder("AQ-MedAI/no-such-drafter")

"""Content identity of what the later stages read: the target's weights (sha256 per shard, hashed once and cached in
the run directory), target.aux_layers, the prepared tokens and the vocabulary are recorded by the stages that read
them, so a change that the cheap identity (size, first and last MiB) misses makes those stages stale, and pre-flight
of train, evaluate and export names the input, its old and new hash, and the command that reruns from the first
stage that read it. One real offline run on a copy of the tiny target, copied per test and then changed."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import yaml
from support.fake_vllm import FakeVLLM
from test_generate_openai import MODEL
from test_train import QUICK

from eaglekit import pipeline, rundir
from eaglekit.config import load_config
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir, file_identity
from eaglekit.stages import generate
from eaglekit.tiny import write_prompts

pytestmark = pytest.mark.slow  # trains and evaluates a drafter

CHECKED = ("train", "evaluate", "export")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_target) -> Path:
    """A folder with `target/` (a copy of the tiny target), `config.yaml` and `run/`, every stage done offline; the
    responses come from a server rendering with the target's tokenizer (so generate does not read the weights)."""
    root = tmp_path_factory.mktemp("identity")
    shutil.copytree(tiny_target, root / "target")
    write_prompts(root / "prompts.jsonl", n=16, seed=3)
    with FakeVLLM(model=MODEL, tokenizer=str(root / "target")) as fake:
        data = {
            "run_dir": "run",
            "target": {"model": str(root / "target")},
            "data": {"prompts": "prompts.jsonl", "eval_fraction": 0.4},
            "generate": {"backend": "openai", "servers": [fake.url], "model": MODEL, "max_tokens": 64},
            "vocab": {"draft_vocab_size": 200},
            "extract": {"mode": "offline"},
            "train": {**QUICK, "max_steps": 2, "eval_every": 2, "save_every": 2},
            "evaluate": {"num_samples": 2, "num_speculative_tokens": [1], "temperatures": [0.0], "max_new_tokens": 8},
            "export": {"verifier": None},
        }
        (root / "config.yaml").write_text(yaml.safe_dump(data))
        cfg = load_config(root / "config.yaml")
        with RunDir(cfg.run_dir).lock:
            for stage in pipeline.stages_for(cfg):
                pipeline.run_stage(cfg, stage, skip_preflight=True)
    return root


@pytest.fixture
def copy(finished, tmp_path):
    """The finished run and its target, copied (so a test may change them); returns a config loader."""
    shutil.copytree(finished, tmp_path / "x", symlinks=True)
    root = tmp_path / "x"
    data = yaml.safe_load((root / "config.yaml").read_text())
    data["target"]["model"] = str(root / "target")

    def config(**target):
        data["target"].update(target)
        (root / "config.yaml").write_text(yaml.safe_dump(data))
        return load_config(root / "config.yaml")

    config.root = root  # type: ignore[attr-defined]
    return config


def upstream(cfg, stage: str):
    return next(r for r in pipeline.run_preflight(pipeline.make_context(cfg, stage)) if r.name == "upstream")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_healthy_copy_passes_and_a_rerun_hashes_nothing(copy, monkeypatch):
    cfg = copy()
    for stage in CHECKED:
        assert upstream(cfg, stage).status == "ok", stage
    hashed: list[str] = []
    real = rundir.sha256_file
    monkeypatch.setattr(rundir, "sha256_file", lambda path, *a: hashed.append(Path(path).name) or real(path, *a))
    for stage in CHECKED:
        assert upstream(cfg, stage).status == "ok", stage
    assert hashed == []  # every digest came from RUN_DIR/.sha256-cache.json


def test_weights_changed_inside_a_shard_are_named_before_train_evaluate_and_export(copy):
    cfg = copy()
    shard = copy.root / "target" / "model.safetensors"
    cheap, old = file_identity(shard), sha256(shard)
    flip_middle_byte(shard)  # same size, first and last MiB unchanged: the cheap identity does not see it
    new = sha256(shard)
    assert file_identity(shard)["sha"] == cheap["sha"] and shard.stat().st_size == cheap["bytes"]
    for stage in CHECKED:
        result = upstream(cfg, stage)
        assert result.status == "fail", stage
        assert "since extract ran, the target's weights (model.safetensors): " in result.detail
        assert f"sha256 {old[:12]} → sha256 {new[:12]}" in result.detail, result.detail
        assert "`eaglekit run CONFIG --from extract --force`" in result.remedy, result.remedy
        assert "generate, prepare, vocab stay valid" in result.remedy
    # the same bytes again are the same target, whatever the file's mtime says
    flip_middle_byte(shard)
    assert all(upstream(cfg, stage).status == "ok" for stage in CHECKED)


def test_changed_aux_layers_are_named_with_old_and_new(copy):
    cfg = copy(aux_layers=[1, 3, 6])
    result = upstream(cfg, "train")
    assert result.status == "fail"
    assert "since extract ran, `target.aux_layers`: unset (the default) → [1, 3, 6]" in result.detail, result.detail
    assert "--from extract --force" in result.remedy


def test_replaced_tokens_and_vocabulary_are_named(copy):
    cfg = copy()
    vocab = copy.root / "run" / "vocab" / "vocab.safetensors"
    old = sha256(vocab)
    data = bytearray(vocab.read_bytes())
    data[-1] ^= 0x01  # a d2t entry changes; the file's origin record (its metadata) stays
    vocab.write_bytes(bytes(data))
    for stage in ("evaluate", "export"):
        result = upstream(cfg, stage)
        assert result.status == "fail"
        assert f"since train ran, the vocabulary (vocab/vocab.safetensors): sha256 {old[:12]} → " in result.detail
        assert "`eaglekit run CONFIG --from train --force`" in result.remedy
        assert "generate, prepare, vocab, extract stay valid" in result.remedy
    vocab.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0x01]))

    tokens = copy.root / "run" / "prepare" / "tokens.safetensors"
    flip_middle_byte(tokens)
    result = upstream(cfg, "train")
    assert result.status == "fail"
    assert "since vocab ran, the prepared tokens (prepare/tokens.safetensors): sha256 " in result.detail
    assert "--from vocab --force" in result.remedy and "(generate, prepare stay valid)" in result.remedy


def test_responses_changed_after_prepare_are_named(copy):
    cfg = copy()
    responses = copy.root / "run" / "generate" / "responses.jsonl"
    old = sha256(responses)
    lines = responses.read_text().splitlines(keepends=True)
    responses.write_text("".join(lines[:-1]))  # e.g. a sample dropped, or another run's file copied in
    result = upstream(cfg, "train")
    assert result.status == "fail"
    assert f"since prepare ran, the generated responses (generate/responses.jsonl): sha256 {old[:12]} → " in (
        result.detail
    )
    assert "`eaglekit run CONFIG --from prepare --force` (generate stays valid)" in result.remedy


def test_generate_records_the_local_targets_weights(copy):
    cfg = copy()
    cfg.generate.backend = "local"
    shard = copy.root / "target" / "model.safetensors"
    weights = generate.params(ResolvedRun(cfg))["model"]["weights"]
    assert weights == {"model.safetensors": sha256(shard)[:16]}


def test_a_first_hash_shows_its_progress_and_a_rerun_does_not(copy, monkeypatch, capsys):
    monkeypatch.setattr(rundir, "SHOW_HASHING_BYTES", 1)  # the tiny target's 5 MB count as large here
    cfg = copy()  # a copy: new paths and inodes, so nothing is cached for it yet
    capsys.readouterr()
    assert upstream(cfg, "train").status == "ok"
    assert "sha256 of the target's weights (hashed once; cached in" in capsys.readouterr().err
    assert upstream(cfg, "train").status == "ok"
    assert "sha256 of" not in capsys.readouterr().err

"""The train stage: the demo drafter learns, kill -9 resume equals an uninterrupted run, finetuning, pre-flight."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.helpers import subprocess_env
from test_extract import prepared_run

from eaglekit.config import TargetConfig
from eaglekit.drafters.eagle3.checkpoint import load_drafter, save_legacy
from eaglekit.drafters.eagle3.init import remap_vocab
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.errors import EaglekitError
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.model.target import embedding_and_head, target_hf_config
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir

pytestmark = pytest.mark.slow  # builds, trains or serves models

QUICK = {"ttt": {"steps": 3}, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2, "eval_samples": 8}


def metrics(cfg) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()]


def train(cfg):
    with RunDir(cfg.run_dir).lock:
        return run_stage(cfg, "train")


def test_demo_drafter_learns(tmp_path, tiny_target):
    """On the tiny target's own kind of text, held-out acc_0 rises far above its start and τ exceeds 1.5."""
    # measured on this CPU (one thread): held-out acc_0 0.01-0.02 -> 0.46-0.61, τ 1.77-2.14 after 40 steps (~8 s)
    cfg = prepared_run(
        tmp_path,
        tiny_target,
        n=160,
        train={
            "ttt": {"steps": 3},
            "batch_size": 8,
            "lr": 6e-3,
            "warmup_steps": 5,
            "max_steps": 40,
            "eval_every": 20,
            "save_every": 40,
            "log_every": 10,
            "eval_samples": 16,
        },
    )
    row = train(cfg)
    evals = [r for r in metrics(cfg) if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    print(
        "acc_k before",
        [round(a, 3) for a in first["acc_k"]],
        "after",
        [round(a, 3) for a in last["acc_k"]],
        "tau",
        round(last["tau"], 3),
        row["counts"],
    )
    assert first["step"] == 0 and last["step"] == 40
    assert last["acc_k"][0] > first["acc_k"][0] + 0.3
    assert last["tau"] > 1.5
    summary = json.loads((Path(cfg.run_dir) / "train" / "summary.json").read_text())
    assert summary["acc_k"] == last["acc_k"] and row["counts"]["acc_k"] == [round(a, 3) for a in last["acc_k"]]
    out = Path(cfg.run_dir) / "train"
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    best = json.loads((out / "checkpoints" / "best" / "best.json").read_text())
    assert best["tau"] == max(r["tau"] for r in evals)


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
            os.kill(os.getpid(), signal.SIGKILL)  # a hard kill: no cleanup, no ledger end event
    loop.Metrics.write = write_then_die
    cfg = load_config(sys.argv[1])
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train")
""")


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_kill_9_resume_equals_an_uninterrupted_run(tmp_path, tiny_target, mode):
    settings = {**QUICK, "max_steps": 7, "save_every": 3, "eval_every": 2, "log_every": 1, "keep_last": 2}
    extract = {"mode": mode, "shard_tokens": 700}  # offline: the resumed run streams fp8 shards from step 3 on
    if mode == "offline":
        extract["dtype"] = "fp8"
    whole = prepared_run(tmp_path / "whole", tiny_target, n=32, train=settings, extract=extract)
    killed = prepared_run(tmp_path / "killed", tiny_target, n=32, train=settings, extract=extract)
    if mode == "offline":
        for cfg in (whole, killed):
            with RunDir(cfg.run_dir).lock:
                run_stage(cfg, "extract", skip_preflight=True)
    ckpts, wa, wb = kill_9_then_resume(whole, killed, ("loss", "loss_k", "acc_k", "tokens", "lr", "grad_norm"))
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-6", "step-7"]  # only the last keep_last are kept
    assert wa.keys() == wb.keys()


def kill_9_then_resume(whole, killed, keys: tuple[str, ...]):
    """Train ``whole`` to the end; train ``killed`` (the same settings: 7 steps, a checkpoint every 3) until a
    SIGKILL after step 5, then again, which resumes from step 3. Asserts both logged the same steps with the same
    ``keys`` and ended at the same weights; returns (killed's checkpoints folder, both final state dicts)."""
    train(whole)
    config = Path(killed.run_dir) / "config.yaml"
    config.write_text(killed.to_yaml())
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(config), "5"],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = Path(killed.run_dir) / "train" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-3"
    assert [r["step"] for r in metrics(killed) if r["kind"] == "train"] == [1, 2, 3, 4, 5]

    row = train(killed)  # `eaglekit train CONFIG` again: resumes from step 3
    assert row["counts"]["steps"] == 7
    a, b = metrics(whole), metrics(killed)
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]  # no step logged twice
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-6), (ra["kind"], ra["step"], key)
    wa = load_file(str(Path(whole.run_dir) / "train/checkpoints/step-7/model.safetensors"))
    wb = load_file(str(ckpts / "step-7" / "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-6, atol=1e-6)
    return ckpts, wa, wb


def saved_drafter(path: Path, target: Path, selected: torch.Tensor, seed: int = 0, **overrides) -> Eagle3Drafter:
    hf = target_hf_config(TargetConfig(model=str(target)))
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(hf, draft_vocab_size=len(selected), **overrides))
    d2t, t2d = build_d2t_t2d(selected, hf.vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    save_legacy(drafter, path)
    return drafter


def test_finetune_keeps_its_vocab_and_remap_reports_new_rows(tmp_path, tiny_target, capsys):
    published = saved_drafter(tmp_path / "published", tiny_target, torch.arange(0, 300, 2))  # 150 even ids
    settings = {**QUICK, "max_steps": 2, "eval_every": 2, "save_every": 2, "init_from": str(tmp_path / "published")}
    keep = prepared_run(tmp_path / "keep", tiny_target, n=24, train=settings)
    row = train(keep)
    assert row["counts"]["draft_vocab"] == "init_from checkpoint"
    trained, _ = load_drafter(Path(keep.run_dir) / "train" / "checkpoints" / "step-2")
    assert torch.equal(trained.d2t, published.d2t) and torch.equal(trained.t2d, published.t2d)
    assert "the vocab stage's mapping is not used" in capsys.readouterr().err

    remap = prepared_run(tmp_path / "remap", tiny_target, n=24, train={**settings, "remap_vocab": True})
    row = train(remap)
    vocab = load_file(str(Path(remap.run_dir) / "vocab" / "vocab.safetensors"))
    new_rows = int((vocab["t2d"] & ~published.t2d).sum())
    assert 0 < new_rows < 200 and row["counts"]["new_lm_head_rows"] == new_rows
    assert f"{new_rows} of 200 lm_head rows are new" in capsys.readouterr().err
    trained, _ = load_drafter(Path(remap.run_dir) / "train" / "checkpoints" / "step-2")
    assert torch.equal(trained.t2d, vocab["t2d"]) and torch.equal(trained.d2t, vocab["d2t"])


def test_lm_head_stays_at_the_targets_rows_unless_told_to_train(tmp_path, tiny_target, capsys):
    """train.freeze_lm_head (the default) keeps the draft head at the target's rows; false trains it; a head with
    no rows to start from (init_lm_head_from_target false) trains whatever the setting, and says so."""
    _, head = embedding_and_head(str(tiny_target))
    for name, settings, state in [
        ("default", {}, "frozen"),
        ("trained", {"freeze_lm_head": False}, "trained"),
        ("random", {"init_lm_head_from_target": False}, "trained"),
    ]:
        cfg = prepared_run(
            tmp_path / name,
            tiny_target,
            n=24,
            train={**QUICK, "max_steps": 2, "eval_every": 2, "save_every": 2, **settings},
        )
        row = train(cfg)
        drafter, _ = load_drafter(Path(cfg.run_dir) / "train" / "checkpoints" / "step-2")
        weight = drafter.lm_head.weight.detach()
        at_target_rows = torch.equal(weight.float(), head[drafter.t2d].to(weight.dtype).float())
        assert row["counts"]["lm_head"] == state and at_target_rows == (name == "default"), name
        if name == "random":
            assert "lm_head trains although train.freeze_lm_head is set" in capsys.readouterr().err


def test_remap_keeps_shared_rows_and_fills_new_ones(tiny_target):
    hf = target_hf_config(TargetConfig(model=str(tiny_target)))
    torch.manual_seed(0)
    old = Eagle3Drafter(DrafterConfig.from_target_config(hf, draft_vocab_size=4))
    old.d2t.copy_(build_d2t_t2d(torch.tensor([3, 5, 7, 9]), hf.vocab_size)[0])
    old.t2d.copy_(build_d2t_t2d(torch.tensor([3, 5, 7, 9]), hf.vocab_size)[1])
    _, head = embedding_and_head(str(tiny_target))
    d2t, t2d = build_d2t_t2d(torch.tensor([1, 5, 9, 11, 12]), hf.vocab_size)
    new, n_new = remap_vocab(old, d2t, t2d, head)
    assert n_new == 3 and new.config.draft_vocab_size == 5
    w = new.lm_head.weight
    torch.testing.assert_close(w[1], old.lm_head.weight[1])  # token 5
    torch.testing.assert_close(w[2], old.lm_head.weight[3])  # token 9
    for row, token in ((0, 1), (3, 11), (4, 12)):
        torch.testing.assert_close(w[row], head[token].float())
    torch.testing.assert_close(new.fc.weight, old.fc.weight)


def test_mismatched_init_from_fails_in_preflight(tmp_path, tiny_target):
    saved_drafter(
        tmp_path / "other",
        tiny_target,
        torch.arange(200),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        target_hidden_size=64,
    )
    cfg = prepared_run(
        tmp_path, tiny_target, n=16, train={**QUICK, "max_steps": 1, "init_from": str(tmp_path / "other")}
    )
    with pytest.raises(EaglekitError, match=r"init_from: .*target_hidden_size.*64.*128"):
        train(cfg)
    assert not (Path(cfg.run_dir) / "train" / "checkpoints").exists()


def offline_run(path: Path, target: Path, dtype: str | None, settings: dict):
    """The same prepared data (same seed) trained online, or offline from features stored in ``dtype``."""
    extract = {"mode": "offline", "dtype": dtype} if dtype else {}
    cfg = prepared_run(path, target, n=40, train=settings, extract={**extract, "shard_tokens": 900})
    with RunDir(cfg.run_dir).lock:
        if dtype:
            run_stage(cfg, "extract", skip_preflight=True)
        run_stage(cfg, "train")
    return [r for r in metrics(cfg) if r["kind"] == "train"]


def test_offline_features_train_like_online(tmp_path, tiny_target):
    """Streamed from several shards, offline features give the losses online training gets on the same data
    (fp32 on the CPU): the same values stored as float32, within bf16's and fp8's rounding otherwise."""
    settings = {**QUICK, "max_steps": 6, "eval_every": 6, "save_every": 6, "log_every": 1, "dtype": "float32"}
    online = offline_run(tmp_path / "online", tiny_target, None, settings)
    runs = {
        dtype: offline_run(tmp_path / dtype, tiny_target, dtype, settings) for dtype in ("float32", "bfloat16", "fp8")
    }
    index = json.loads((tmp_path / "fp8" / "run" / "extract" / "index.json").read_text())
    assert len(index["shards"]) >= 3  # the order streams several shards
    # measured: float32 8e-8, bfloat16 5e-5, fp8 9e-4 (largest relative difference over the logged steps)
    tolerance = {"float32": 1e-5, "bfloat16": 1e-3, "fp8": 1e-2}
    for dtype, rows in runs.items():
        assert [r["step"] for r in rows] == [r["step"] for r in online]
        worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rows, online, strict=False))
        print(dtype, "largest relative loss difference to online", f"{worst:.2e}")
        assert worst < tolerance[dtype], (dtype, worst)
        assert rows[-1]["tokens"] == online[-1]["tokens"]  # the same samples, in the same order

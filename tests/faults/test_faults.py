"""Nothing silent under faults: a feature shard whose bytes changed on disk, a step whose loss or gradient is not
finite, a drafter checkpoint with non-finite weights, and a peer rank that dies or never joins. Each stops with an
EaglekitError that names the file, step, tensor or rank, and the remedy."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_extract import offline, prepared_run
from test_train import QUICK, metrics, train
from test_train_ddp import free_port, torchrun_env

from eaglekit import atomic, rundir
from eaglekit.data import shards as sh
from eaglekit.drafters.eagle3.objective import TTT
from eaglekit.errors import EaglekitError
from eaglekit.pipeline import make_context, run_stage
from eaglekit.preflight import files
from eaglekit.preflight.drafter import drafter_checkpoint
from eaglekit.rundir import RunDir
from eaglekit.stages import extract
from eaglekit.stages import train as train_stage

pytestmark = pytest.mark.slow  # builds, trains or serves models


# ------------------------------------------------------------------------------------- shard contents


def flip_a_byte(path: Path) -> None:
    """One byte in the middle of the file changed, the size kept: what a bad disk or copy does."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_shard_whose_bytes_changed_fails_trains_preflight_and_extract_redoes_only_it(
    tmp_path, tiny_target, monkeypatch
):
    cfg = offline(tmp_path, tiny_target)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract", skip_preflight=True)
    out = Path(cfg.run_dir) / "extract"
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) >= 3 and files.feature_shard_contents in train_stage.checks(cfg)

    ctx = make_context(cfg, "train")  # its fingerprint hashes the vocabulary, once
    hashed: list[str] = []
    real_sha = rundir.sha256_file  # the one hashing function of every content hash
    monkeypatch.setattr(rundir, "sha256_file", lambda path, *a: hashed.append(Path(path).name) or real_sha(path, *a))
    first = files.feature_shard_contents(ctx)
    assert first.status == "ok" and "all hashed now" in first.detail, first.detail
    assert sorted(hashed) == [s.name for s in shards]
    # the cache (in the run directory) spares a rerun the hashing: nothing is read again
    hashed.clear()
    again = files.feature_shard_contents(make_context(cfg, "train"))
    assert again.status == "ok" and hashed == [], again.detail
    assert set(json.loads((out / sh.DIGEST_CACHE).read_text())) == {s.name for s in shards}

    bad = shards[1]
    expected = json.loads(sh.sidecar_path(bad).read_text())["sha256"]
    flip_a_byte(bad)
    actual = real_sha(bad)
    hashed.clear()
    result = files.feature_shard_contents(make_context(cfg, "train"))
    assert hashed == [bad.name]  # only the changed file is read again
    assert result.status == "fail"
    assert bad.name in result.detail and expected in result.detail and actual in result.detail
    assert "--from extract" in result.remedy and "only that shard" in result.remedy
    # the header and size checks see nothing wrong: only the bytes differ
    assert files.feature_shards(make_context(cfg, "train")).status == "ok"

    # the remedy: the finished extract counts that shard as damaged and re-extracts it, and only it
    ctx = make_context(cfg, "extract")
    assert bad.name in (extract.damaged(ctx) or "") and actual in extract.damaged(ctx)
    assert extract.existing_shards(ctx).status == "ok" and "re-extracted" in extract.existing_shards(ctx).detail
    others = {s.name: s.stat().st_mtime_ns for s in shards if s != bad}
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "extract")
    assert not row.get("skipped")
    assert {s.name: s.stat().st_mtime_ns for s in shards if s != bad} == others
    assert real_sha(bad) == json.loads(sh.sidecar_path(bad).read_text())["sha256"]
    assert extract.damaged(make_context(cfg, "extract")) is None
    assert files.feature_shard_contents(make_context(cfg, "train")).status == "ok"


# ----------------------------------------------------------------------------------------- non-finite


GUARDED = {**QUICK, "max_steps": 6, "save_every": 2, "eval_every": 2, "log_every": 1}


def ledger_end(cfg, stage: str) -> dict:
    events = [json.loads(line) for line in (Path(cfg.run_dir) / "ledger.jsonl").read_text().splitlines()]
    return [e for e in events if e["stage"] == stage and e["event"] == "end"][-1]


def nan_at_step_3(forward):
    """The objective's forward, its loss NaN on the third training micro-batch (step 3 with grad_accum 1)."""
    training_calls = []

    def patched(self, *args, **kwargs):
        loss, out = forward(self, *args, **kwargs)
        if self.training:
            training_calls.append(1)
            if len(training_calls) == 3:
                loss = loss * float("nan")
        return loss, out

    return patched


def test_a_nan_loss_stops_training_before_its_step_and_the_last_checkpoint_stays_the_resume_point(
    tmp_path, tiny_target, monkeypatch
):
    cfg = prepared_run(tmp_path, tiny_target, n=32, train=GUARDED)
    monkeypatch.setattr(TTT, "forward", nan_at_step_3(TTT.forward))
    with pytest.raises(EaglekitError) as stopped:
        train(cfg)
    message = stopped.value.message
    assert "step 3: the loss is nan" in message and "lr " in message, message
    assert "checkpoint step-2 stays the resume point" in message
    assert "train.lr" in stopped.value.remedy and "resume from step-2" in stopped.value.remedy
    ckpts = Path(cfg.run_dir) / "train" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2"]  # nothing of step 3 was saved
    assert all(torch.isfinite(t).all() for t in load_file(str(ckpts / "step-2" / "model.safetensors")).values())
    assert [r["step"] for r in metrics(cfg) if r["kind"] == "train"] == [1, 2]
    assert ledger_end(cfg, "train")["state"] == "failed" and "the loss is nan" in ledger_end(cfg, "train")["error"]

    # a passing fault: the rerun resumes from step-2 and finishes
    monkeypatch.undo()
    row = train(cfg)
    assert row["counts"]["steps"] == 6 and (ckpts / "latest").read_text().strip() == "step-6"


def test_a_huge_learning_rate_stops_at_the_first_non_finite_step(tmp_path, tiny_target):
    """lr 1e30 (finite, so the config accepts it): the first updates blow the weights up; the step that turns
    them, its loss or its gradient non-finite is named, and nothing non-finite is saved."""
    cfg = prepared_run(tmp_path, tiny_target, n=32, train={**GUARDED, "lr": 1e30, "warmup_steps": 0, "save_every": 1})
    with pytest.raises(EaglekitError) as stopped:
        train(cfg)
    message = stopped.value.message
    assert re.search(r"train: step \d+: .* \(lr \d(\.\d+)?e\+(29|30) at this step\)", message), message
    assert any(what in message for what in ("the loss is", "the gradient norm is", "non-finite weights"))
    ckpts = Path(cfg.run_dir) / "train" / "checkpoints"
    for folder in ckpts.glob("step-*"):
        weights = load_file(str(folder / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), folder.name


def test_an_update_that_leaves_a_weight_non_finite_is_named_before_it_is_saved(tmp_path):
    """A finite gradient times a huge lr can overflow a weight: the check after the optimizer names the tensor."""
    from eaglekit.training.guard import NonFiniteTraining, refuse_non_finite_weights
    from eaglekit.training.step_checkpoints import STATE, Checkpoints

    ckpts = Checkpoints(tmp_path / "checkpoints", 2)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-4").mkdir()
    (tmp_path / "checkpoints" / "step-4" / STATE).write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step-4\n")
    finite = [("module.drafter.norm.weight", torch.ones(8)), ("module.drafter.fc.weight", torch.ones(4, 8))]
    refuse_non_finite_weights(5, finite, 1e-3, ckpts)
    overflowed = finite[1][1].clone()
    overflowed[0, :2] = torch.tensor(3e38) * 10  # fp32 overflows to inf
    with pytest.raises(NonFiniteTraining) as stopped:
        refuse_non_finite_weights(5, [finite[0], ("module.drafter.fc.weight", overflowed)], 1e30, ckpts)
    message = stopped.value.message
    assert "step 5: the update left non-finite weights: drafter.fc.weight (2 values)" in message, message
    assert "lr 1e+30" in message and "checkpoint step-4 stays the resume point" in message


def test_evaluate_and_export_refuse_a_drafter_with_non_finite_weights(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=32, train={**QUICK, "max_steps": 2, "eval_every": 2})
    train(cfg)
    best = Path(cfg.run_dir) / "train" / "checkpoints" / "best"
    for stage in ("evaluate", "export"):
        assert drafter_checkpoint(make_context(cfg, stage)).status == "ok"
    weights = load_file(str(best / "model.safetensors"))
    weights["fc.weight"][0, :3] = float("nan")
    weights["fc.weight"][1, 0] = float("inf")
    with atomic.atomic_dir(best, digests=True) as tmp:  # as training writes a diverged drafter: digests and all
        for f in best.iterdir():
            if f.name != atomic.DIGESTS:
                shutil.copy(f, tmp / f.name)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for stage in ("evaluate", "export"):
        result = drafter_checkpoint(make_context(cfg, stage))
        assert result.status == "fail" and "non-finite" in result.detail, result.detail
        assert f"fc.weight (4 of {weights['fc.weight'].numel():,} values)" in result.detail
        assert "train.lr" in result.remedy


# ------------------------------------------------------------------------------------- distributed faults

TWO_RANKS = {**GUARDED, "batch_size": 2, "eval_samples": 4, "warmup_steps": 1}


def two_rank_worker(rank: int, port: int, config: str, reports: str, fault: str) -> None:
    """One torchrun rank of the train stage, writing the error it stopped on to ``reports``/rank{rank}.json.
    Rank 1 only: ``kill``: it is killed (SIGKILL: no cleanup) as it starts step 3; ``nan``: its loss of step 3 is
    NaN (the other rank's is finite)."""
    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage_as_worker
    from eaglekit.training import loop

    torch.set_num_threads(1)
    torchrun_env(rank, 2, port)
    cfg = load_config(config)
    if rank == 1 and fault == "kill":
        step = loop.optimizer_step

        def killed_at_step_3(model, loader, features, window, index, *rest):
            if index == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(model, loader, features, window, index, *rest)

        loop.optimizer_step = killed_at_step_3
    if rank == 1 and fault == "nan":
        TTT.forward = nan_at_step_3(TTT.forward)
    try:
        if rank == 0:
            with RunDir(cfg.run_dir).lock:
                run_stage(cfg, "train")
        else:
            run_stage_as_worker(cfg, "train")
    except EaglekitError as err:
        said = {"type": type(err).__name__, "message": err.message, "remedy": err.remedy}
        (Path(reports) / f"rank{rank}.json").write_text(json.dumps(said))


def run_two_ranks(tmp_path, tiny_target, fault: str, mode: str = "ddp") -> tuple[object, list, dict]:
    """(the config, the two processes, what each rank stopped on)."""
    cfg = prepared_run(tmp_path, tiny_target, n=32, train={**TWO_RANKS, "distributed": mode})
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    args = (port, str(config), str(tmp_path), fault)
    ranks = [spawn.Process(target=two_rank_worker, args=(r, *args)) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    for p in ranks:
        if p.is_alive():
            p.kill()
    reports = {
        r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1) if (tmp_path / f"rank{r}.json").exists()
    }
    return cfg, ranks, reports


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_nan_loss_on_one_rank_stops_both_ranks_before_the_step(tmp_path, tiny_target, mode):
    cfg, ranks, said = run_two_ranks(tmp_path, tiny_target, "nan", mode)
    # rank 0's own loss is finite: it stops because the ranks share a flag (alone, it would see only a NaN
    # gradient norm after DDP's all-reduce, or wait forever in the next collective)
    assert "step 3: the loss is not finite on another rank" in said[0]["message"], said
    assert "step 3: the loss is nan" in said[1]["message"]
    assert all(s["type"] == "NonFiniteTraining" for s in said.values())
    ckpts = Path(cfg.run_dir) / "train" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2" and not (ckpts / "step-3").exists()


def test_a_peer_rank_killed_mid_training_is_named_an_infrastructure_fault_on_the_survivor(tmp_path, tiny_target):
    cfg, ranks, said = run_two_ranks(tmp_path, tiny_target, "kill")
    assert ranks[1].exitcode == -signal.SIGKILL
    message = said[0]["message"]
    # before: "train stopped on an unexpected error: RuntimeError: [...gloo...] Connection reset by peer ..."
    assert said[0]["type"] == "InfrastructureFault" and "unexpected" not in message, message
    assert f"train: rank 0 of 2 (local rank 0 on {socket.gethostname()})" in message
    assert "a peer rank died" in message and re.search("Connection (closed|reset) by peer", message), message
    assert "infrastructure fault, not an eaglekit bug" in message
    latest = (Path(cfg.run_dir) / "train" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-2" and f"checkpoint {Path(cfg.run_dir) / 'train' / 'checkpoints' / latest}" in message
    assert "rerun the same command on every node" in said[0]["remedy"]
    end = ledger_end(cfg, "train")
    assert end["state"] == "failed" and end["reason"] == "infrastructure fault"


def test_a_node_that_never_joins_is_named(tmp_path, tiny_target, monkeypatch):
    """World size 2 with only rank 0 started: init times out waiting for the other rank."""
    from eaglekit.training import distributed

    cfg = prepared_run(tmp_path, tiny_target, n=32, train=TWO_RANKS)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(distributed, "TIMEOUT", datetime.timedelta(seconds=2))
    with pytest.raises(EaglekitError) as stopped:
        train(cfg)
    message = stopped.value.message
    assert type(stopped.value).__name__ == "InfrastructureFault" and "unexpected" not in message, message
    assert "rank 0 of 2 (local rank 0" in message and "not every rank joined" in message
    assert "1/2 clients joined" in message and "no checkpoint yet" in message


def hanging_peer_worker(rank: int, port: int, report: str) -> None:
    """Two ranks in barriers; rank 1 stops answering after the first: rank 0's barrier times out."""
    from eaglekit.training import distributed

    torchrun_env(rank, 2, port)
    distributed.TIMEOUT = datetime.timedelta(seconds=3)
    distributed.init()
    distributed.barrier()
    if rank == 1:
        time.sleep(8)
        return
    try:
        distributed.barrier()
    except RuntimeError as err:
        found = distributed.fault(err)
        Path(report).write_text(json.dumps(found and [found.kind, found.what, found.detail]))


def test_a_collective_that_times_out_is_named(tmp_path):
    spawn, report = multiprocessing.get_context("spawn"), tmp_path / "rank0.json"
    port = free_port()
    ranks = [spawn.Process(target=hanging_peer_worker, args=(r, port, str(report))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=60)
    kind, what, detail = json.loads(report.read_text())
    assert kind == "timeout" and "another rank stopped answering" in what and "Timed out" in detail


@pytest.mark.parametrize(
    "error, kind",
    [
        (  # NCCL, a peer process gone (what DistBackendError says on a GPU node)
            torch.distributed.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL "
                "version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
                "exiting prematurely."
            ),
            "peer",
        ),
        (
            torch.distributed.DistBackendError(
                "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE, "
                "NumelIn=1, Timeout(ms)=600000) ran for 600011 milliseconds before timing out."
            ),
            "timeout",
        ),
        (
            torch.distributed.DistNetworkError(
                "The client socket has timed out after 900000ms while trying to connect to (10.0.0.1, 29500)."
            ),
            "init",
        ),
        # a CUDA fault inside NCCL, and an ordinary bug, are not the machines': they stay unexpected errors
        (torch.distributed.DistBackendError("NCCL error: ncclUnhandledCudaError: Call to CUDA function failed."), None),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)"), None),
    ],
)
def test_distributed_faults_are_told_from_bugs(error, kind):
    from eaglekit.training import distributed

    try:
        raise RuntimeError("wrapped") from error  # found behind a cause too
    except RuntimeError as wrapped:
        found = distributed.fault(wrapped)
    assert (found.kind if found else None) == kind

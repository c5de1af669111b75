"""Multi-process training on CPU (gloo): 2 processes on halves of a batch = 1 process on the whole batch (the loss
weighted by tokens across ranks), and the train stage under 2 ranks (rank 0 owns the run directory, rank 1 only
computes)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter

pytestmark = pytest.mark.slow  # builds, trains or serves models

CFG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=128,
    vocab_size=50,
    draft_vocab_size=30,
    target_hidden_size=24,
    aux_layer_ids=None,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def end_ranks() -> None:
    """A worker's last step: a barrier, so neither rank tears gloo down while the other still works in it (an abort
    at exit, seen once in CI), then the process group destroyed. A worker deletes its DDP model first: DDP's reducer
    holds the group, and a group freed through the reducer is destroyed with the GIL held while gloo's thread needs
    the GIL to free the barrier's work, a deadlock (a rank hung in ~ProcessGroupGloo in CI, torch 2.x)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(DrafterConfig(**CFG)).double()


def batch():
    """4 rows; rows 0/1 and 2/3 share their padding and loss-mask pattern, so each rank's half counts as many
    positions per TTT step as the other (then the mean of the two halves' means is the mean of the whole)."""
    g = torch.Generator().manual_seed(1)
    b, length = 4, 14
    ids = torch.randint(0, CFG["vocab_size"], (b, length), generator=g)
    attention = torch.ones(b, length, dtype=torch.long)
    attention[2:, 10:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :3] = 0
    aux = torch.randn(b, length, 3 * CFG["target_hidden_size"], generator=g, dtype=torch.float64)
    logits = torch.randn(b, length, CFG["draft_vocab_size"], generator=g, dtype=torch.float64) * 3
    return aux, ids, logits, loss_mask, attention, None


def unequal_batch():
    """4 rows whose halves count very different numbers of positions: rank 0's rows are short and mostly prompt,
    rank 1's long. The mean of the two halves' means would weigh rank 0's few positions as much as rank 1's many."""
    aux, ids, logits, loss_mask, attention, _ = batch()
    attention = torch.ones_like(attention)
    attention[0, 6:] = 0
    attention[2, 8:] = 0
    loss_mask = attention.clone()
    loss_mask[[0, 2], :4] = 0
    return aux, ids, logits, loss_mask, attention, None


BATCHES = {"equal": batch, "unequal": unequal_batch}


def halves_worker(rank: int, world: int, port: int, out: str, mode: str, which: str = "equal") -> None:
    from eaglekit.drafters.eagle3.objective import TTT
    from eaglekit.training import distributed as dist
    from eaglekit.training.data import rank_share
    from eaglekit.training.distributed import wrap

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    model = wrap(TTT(drafter(), TTTConfig(steps=3, decay=0.8)), mode, torch.device("cpu"))
    rows = rank_share(list(range(4)), dist.rank(), dist.world_size())
    loss, _ = model(*[t[rows] if t is not None else None for t in BATCHES[which]()])
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.").removeprefix("drafter.")] = g.detach().clone()
    torch.save({"loss": loss.detach(), "grads": grads}, Path(out) / f"rank{rank}.pt")
    del model
    end_ranks()


@pytest.mark.parametrize("mode, which", [("ddp", "equal"), ("fsdp", "equal"), ("ddp", "unequal"), ("fsdp", "unequal")])
def test_two_processes_on_halves_equal_one_on_the_whole(tmp_path, mode, which):
    from eaglekit.drafters.eagle3.objective import TTT

    mp.spawn(halves_worker, args=(2, free_port(), str(tmp_path), mode, which), nprocs=2, join=True)
    single = TTT(drafter(), TTTConfig(steps=3, decay=0.8))
    loss, out = single(*BATCHES[which]())
    loss.backward()
    if which == "unequal":
        halves = [
            TTT(drafter(), TTTConfig(steps=3, decay=0.8))(
                *[t[rows] if t is not None else None for t in unequal_batch()]
            )[1]
            for rows in ([0, 2], [1, 3])
        ]
        assert halves[0].count_k[0] * 2 < halves[1].count_k[0], "the halves must count unequal numbers of positions"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss.detach(), rtol=1e-10, atol=1e-12)
    expected = {n.removeprefix("drafter."): p.grad for n, p in single.named_parameters() if p.grad is not None}
    assert set(expected) == set(ranks[0]["grads"]) and "fc.weight" in expected
    for name, grad in expected.items():
        for r in ranks:  # gradients are averaged across ranks: each holds the whole batch's gradient
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-9, atol=1e-12, msg=f"{mode} {name}")


def stage_worker(rank: int, world: int, port: int, config: str) -> None:
    from eaglekit.config import load_config
    from eaglekit.pipeline import run_stage, run_stage_as_worker
    from eaglekit.rundir import RunDir

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    cfg = load_config(config)
    if rank == 0:  # what `eaglekit train CONFIG` does under torchrun: rank 0 owns the lock and the ledger
        with RunDir(cfg.run_dir).lock:
            run_stage(cfg, "train")
    else:
        run_stage_as_worker(cfg, "train")


def test_train_stage_under_two_ranks(tmp_path, tiny_target):
    from test_extract import prepared_run

    cfg = prepared_run(
        tmp_path,
        tiny_target,
        n=32,
        train={
            "ttt": {"steps": 2},
            "batch_size": 2,
            "max_steps": 4,
            "eval_every": 2,
            "save_every": 2,
            "log_every": 1,
            "eval_samples": 4,
            "warmup_steps": 1,
        },
    )
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    mp.spawn(stage_worker, args=(2, free_port(), str(config)), nprocs=2, join=True)

    out = Path(cfg.run_dir) / "train"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]  # one writer: no duplicate lines
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["acc_k"]) == 2
    events = [
        e
        for e in (json.loads(line) for line in (Path(cfg.run_dir) / "ledger.jsonl").read_text().splitlines())
        if e["stage"] == "train"
    ]
    assert [e["event"] for e in events] == ["start", "end"] and events[-1]["state"] == "done"


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_drafter_train_stage_under_two_ranks(tmp_path, tiny_target, family):
    """The block families go through the same loop under torchrun: rank 0 writes, both ranks end on one drafter."""
    from safetensors.torch import load_file
    from test_extract import prepared_run

    from eaglekit.drafters.registry import family_of_folder

    cfg = prepared_run(
        tmp_path,
        tiny_target,
        n=32,
        train={
            "batch_size": 2,
            "max_steps": 4,
            "eval_every": 2,
            "save_every": 2,
            "log_every": 1,
            "eval_samples": 4,
            "warmup_steps": 1,
            "draft": {"architecture": family, "num_layers": 1, "block_size": 4, "shared_k_norm": True},
        },
    )
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(cfg.to_yaml())
    mp.spawn(stage_worker, args=(2, free_port(), str(config)), nprocs=2, join=True)

    out = Path(cfg.run_dir) / "train"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert family_of_folder(out / "checkpoints" / "step-4").name == family
    late, early = (load_file(str(out / "checkpoints" / f"step-{n}" / "model.safetensors")) for n in (4, 2))
    assert not torch.equal(late["fc.weight"], early["fc.weight"])  # it trained between the checkpoints
    assert ("markov_head.markov_w1.weight" in late) == (family == "dspark")

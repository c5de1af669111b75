"""Context parallelism (train.context_parallel): real gloo ranks, each holding a contiguous piece of every row's
positions (its features and target rows), give the single-process TTT step's loss and every gradient, in fp64, with
packed documents, a sliding window, sequence normalisation, checkpointed steps, MLA, and with data parallelism
(2 x 2 ranks under DDP); and the block drafters' (DFlash, DSpark) step likewise, split 2 and 3 ways."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_train_ddp import CFG, end_ranks, free_port, torchrun_env

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.fused import StepKernels
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_loss

pytestmark = pytest.mark.slow  # spawns ranks

STEPS = 3
MLA = dict(architecture="mla", num_key_value_heads=None, head_dim=None, q_lora_rank=16, kv_lora_rank=12,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)  # fmt: skip

# name: (drafter config changes, packed rows, loss normalisation, checkpointed steps)
CASES = {
    "plain": ({}, False, "token", False),
    "packed": ({}, True, "token", False),
    "packed_window": ({"sliding_window": 5}, True, "token", False),
    "window_sequence": ({"sliding_window": 4}, True, "sequence", False),
    "checkpointed": ({"sliding_window": 6}, True, "token", True),
    "mla_packed": (MLA, True, "token", False),
}


def drafter(changes: dict) -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(dataclasses.replace(DrafterConfig(**CFG), **changes)).double()


def batch(packed: bool):
    """2 rows of 17 positions (odd: the ranks' pieces differ, 9 and 8): the second right-padded; packed rows hold
    documents that cross the ranks' boundary at position 9; some targets outside the draft vocabulary."""
    g = torch.Generator().manual_seed(3)
    b, length = 2, 17
    ids = torch.randint(0, CFG["vocab_size"], (b, length), generator=g)
    attention = torch.ones(b, length, dtype=torch.long)
    attention[1, 13:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :2] = 0
    loss_mask[0, 7:9] = 0
    aux = torch.randn(b, length, 3 * CFG["target_hidden_size"], generator=g, dtype=torch.float64)
    logits = torch.randn(b, length, CFG["draft_vocab_size"], generator=g, dtype=torch.float64) * 3
    in_draft = torch.rand(b, length, generator=g) > 0.15
    positions = None
    if packed:  # documents [0, 6), [6, 17) and [0, 4), [4, 12), [12, 17)
        starts = ([0, 6], [0, 4, 12])
        positions = torch.stack(
            [torch.cat([torch.arange(e - s) for s, e in zip(row, [*row[1:], length], strict=True)]) for row in starts]
        )
    return aux, ids, logits, loss_mask, attention, in_draft, positions


def step(model: Eagle3Drafter, inputs, normalization: str, kernels: StepKernels, normalizer=None):
    aux, ids, logits, loss_mask, attention, in_draft, positions = inputs
    out = ttt_loss(
        model, aux, ids, logits, loss_mask, attention, target_in_draft=in_draft, position_ids=positions,
        settings=TTTConfig(steps=STEPS, loss_normalization=normalization), kernels=kernels, normalizer=normalizer,
    )  # fmt: skip
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def cases_worker(rank: int, world: int, port: int, out: str) -> None:
    from eaglekit.training import distributed as dist

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    context = dist.context_group(world)
    assert context is not None
    results = {}
    for name, (changes, packed, normalization, checkpointed) in CASES.items():
        aux, ids, logits, loss_mask, attention, in_draft, positions = batch(packed)
        shard = context.shard(ids.shape[1], STEPS)
        inputs = (shard.inputs(aux), ids, shard.inputs(logits), loss_mask, attention, shard.inputs(in_draft), positions)
        kernels = StepKernels(checkpoint_steps=checkpointed, context=context)
        result, grads = step(drafter(changes), inputs, normalization, kernels)
        results[name] = {"loss": result.loss.detach(), "count_k": result.count_k, "grads": grads,
                         "piece": (shard.start, shard.end, shard.stop)}  # fmt: skip
    torch.save(results, Path(out) / f"rank{rank}.pt")
    end_ranks()


def test_two_ranks_splitting_each_row_equal_one_process(tmp_path):
    mp.spawn(cases_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["plain"]["piece"] for r in ranks] == [(0, 9, 12), (9, 17, 17)]  # 9 + 8 positions, a halo of 3
    for name, (changes, packed, normalization, checkpointed) in CASES.items():
        single, grads = step(drafter(changes), batch(packed), normalization, StepKernels(checkpoint_steps=checkpointed))
        parts = [r[name] for r in ranks]
        assert all(p["count_k"][0] > 0 for p in parts), f"{name}: each rank must count chains of its own"
        assert [a + b for a, b in zip(parts[0]["count_k"], parts[1]["count_k"], strict=True)] == single.count_k
        # each rank's loss is its chains' share of the whole: they add up to the single process's loss
        torch.testing.assert_close(parts[0]["loss"] + parts[1]["loss"], single.loss.detach(), rtol=1e-12, atol=1e-13)
        assert set(grads) == set(parts[0]["grads"]) and "fc.weight" in grads
        for param, grad in grads.items():  # the gradient of the whole loss is the ranks' gradients summed
            torch.testing.assert_close(
                parts[0]["grads"][param] + parts[1]["grads"][param], grad, rtol=1e-10, atol=1e-12, msg=f"{name} {param}"
            )


def ddp_worker(rank: int, world: int, port: int, out: str, mode: str, normalization: str) -> None:
    from eaglekit.drafters.eagle3.objective import TTT
    from eaglekit.training import distributed as dist
    from eaglekit.training.data import rank_share
    from eaglekit.training.distributed import wrap

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    context = dist.context_group(2)
    assert context is not None
    groups, group = dist.data_parallel(context)
    rows = rank_share(list(range(4)), group, groups)
    whole = four_rows()
    shard = context.shard(whole[1].shape[1], STEPS)
    mine = [t[rows] if t is not None else None for t in whole]
    heavy = (0, 2, 5)  # aux, target logits, in-draft: this rank's positions only
    inputs = [shard.inputs(t) if i in heavy else t for i, t in enumerate(mine)]
    objective = TTT(drafter({"sliding_window": 5}), TTTConfig(steps=STEPS, decay=0.8, loss_normalization=normalization),
                    kernels=StepKernels(context=context))  # fmt: skip
    model = wrap(objective, mode, torch.device("cpu"))
    loss, _ = model(*inputs)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.").removeprefix("drafter.")] = g.detach().clone()
    torch.save({"loss": loss.detach(), "grads": grads}, Path(out) / f"rank{rank}.pt")
    del model
    end_ranks()


def four_rows():
    """Two packed batches stacked: 4 rows, rows 0/2 for data group 0 and 1/3 for group 1 (rank_share's order)."""
    a, b = batch(True), batch(True)
    g = torch.Generator().manual_seed(9)
    b = (b[0] + torch.randn(b[0].shape, generator=g, dtype=torch.float64), *b[1:])  # other features, same layout
    return tuple(torch.cat([x, y]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode, normalization", [("ddp", "sequence"), ("fsdp", "token")])
def test_data_parallel_times_context_parallel_equals_one_process(tmp_path, mode, normalization):
    """4 ranks: 2 data-parallel groups of 2 splitting each row; sequence normalisation counts each document once
    over all of them."""
    from eaglekit.drafters.eagle3.objective import TTT

    mp.spawn(ddp_worker, args=(4, free_port(), str(tmp_path), mode, normalization), nprocs=4, join=True)
    single = TTT(drafter({"sliding_window": 5}), TTTConfig(steps=STEPS, decay=0.8, loss_normalization=normalization))
    loss, _ = single(*four_rows())
    loss.backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    # each rank's loss is its share times the world (which the gradient averaging divides out again)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / 4, loss.detach(), rtol=1e-12, atol=1e-13)
    expected = {n.removeprefix("drafter."): p.grad for n, p in single.named_parameters() if p.grad is not None}
    assert set(expected) == set(ranks[0]["grads"])
    for name, grad in expected.items():
        for r in ranks:  # averaged over the 4 ranks: every rank holds the whole batch's gradient
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-10, atol=1e-12, msg=f"{mode} {name}")


@pytest.mark.parametrize("architecture", ["llama", "dflash"])
def test_train_stage_splits_rows_across_two_ranks(tmp_path, tiny_target, architecture):
    """`eaglekit train` under torchrun with train.context_parallel 2 on offline features: the two ranks train one
    run on the rows a single process would see, to its loss (the first step's exactly; the second's after one AdamW
    update in fp32) and its token count. A block drafter's ranks read the target's rows a block past their own (the
    halo) and draw the anchors one process draws."""
    from test_extract import prepared_run
    from test_train_ddp import stage_worker

    from eaglekit.config import parse_config
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir

    # a block drafter reads no train.ttt; its slots weigh nearly alike, so the labels of a block's far slots (on
    # the next rank, past a halo shorter than the block) count
    objective = {"ttt": {"steps": 2}} if architecture == "llama" else {}
    weighting = {} if architecture == "llama" else {"position_weighting": "exp-decay", "decay_gamma": 64.0}
    train = {**objective, "batch_size": 1, "packing": True, "pack_length": 320, "max_steps": 2, "eval_every": 2,
             "save_every": 2, "log_every": 1, "eval_samples": 4, "warmup_steps": 1,
             "draft": {"architecture": architecture, "sliding_window": 48, **weighting}}  # fmt: skip
    cfg = prepared_run(tmp_path, tiny_target, n=32, extract={"mode": "offline"}, train=train)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "extract", skip_preflight=True)
        run_stage(cfg, "train", skip_preflight=True)
    out = Path(cfg.run_dir) / "train"
    single = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)  # context_parallel leaves the train fingerprint as it is: the finished run would be kept

    split = parse_config({**cfg.model_dump(mode="json", exclude={"source"}),
                          "train": {**train, "context_parallel": 2}})  # fmt: skip
    config = Path(cfg.run_dir) / "config.yaml"
    config.write_text(split.to_yaml())
    mp.spawn(stage_worker, args=(2, free_port(), str(config)), nprocs=2, join=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]  # one writer
    assert [r["kind"] for r in rows] == [r["kind"] for r in single]
    for r, s in zip(rows, single, strict=True):
        assert r.get("tokens") == s.get("tokens")  # each row's tokens counted once, not once per rank
        tight = r["kind"] == "eval" and r["step"] == 0 or r["step"] == 1
        torch.testing.assert_close(r["loss"], s["loss"], rtol=1e-5 if tight else 1e-3, atol=0)
    ledger = [json.loads(line) for line in (Path(cfg.run_dir) / "ledger.jsonl").read_text().splitlines()]
    assert [e["state"] for e in ledger if e["stage"] == "train" and e["event"] == "end"] == ["done", "done"]


def test_preflight_names_ranks_for_a_row_too_long_for_one_gpu(tmp_path, tiny_target, monkeypatch):
    """A 128K-token row that fits no GPU even checkpointed: the step-memory check refuses it and names the ranks
    per row that fit (the per-rank memory of the model); configured with them, it passes, per rank."""
    import sys

    from support.fake_nvml import GB, fake_pynvml, gpu
    from test_preflight_gpus import make_ctx

    from eaglekit.contract import Sizes
    from eaglekit.progress import human_bytes
    from eaglekit.stages.train import estimate, step_memory_both, step_memory_check

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    train = {"packing": True, "pack_length": 131072, "batch_size": 1, "ttt": {"activation_checkpointing": True}}
    vocab = {"draft_vocab_size": 200}
    ctx = make_ctx(tmp_path, tiny_target, stage="train", train=train, vocab=vocab)
    one = step_memory_both(ctx.cfg)
    four = step_memory_both(ctx.cfg, 4)
    two = step_memory_both(ctx.cfg, 2)
    assert one and two and four
    assert four[1].total < two[1].total < one[1].total
    # a rank of 4 keeps a quarter of the activations, and the whole row's step-0 keys and values
    assert four[1].activations == pytest.approx(one[1].activations / 4, rel=1e-3) and four[1].gathered > 0
    monkeypatch.setitem(
        sys.modules, "pynvml", fake_pynvml([gpu(0, used=0, total=(four[1].total + two[1].total) / 2 / GB)])
    )
    refused = step_memory_check(ctx)
    assert refused.status == "fail" and "does not fit" in refused.detail
    assert "train.context_parallel: 4" in refused.remedy and "sliding_window" in refused.remedy

    split = make_ctx(tmp_path, tiny_target, stage="train", train={**train, "context_parallel": 4}, vocab=vocab)
    fits = step_memory_check(split)
    assert fits.status == "ok" and "a rank of 4 splitting each row" in fits.detail

    # `plan` gives one rank's memory for a few splits of such a row
    sizes = Sizes(None, None, None, None, None, None, None, None, "bfloat16")
    [line] = [h for h in estimate(ctx, sizes).how if "train.context_parallel" in h]
    assert f"N=4 {human_bytes(four[1].total)}" in line


def test_every_family_splits_rows_and_what_cannot_split_is_refused_with_its_reason():
    from eaglekit.config import parse_config
    from eaglekit.errors import UsageError
    from eaglekit.training import distributed as dist

    base = {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}, "extract": {"mode": "offline"}}
    for family in ("llama", "mla", "dflash", "dspark"):  # every family's objective splits, on offline features
        split = parse_config({**base, "train": {"context_parallel": 2, "draft": {"architecture": family}}})
        assert split.train.context_parallel == 2 and split.train.draft.family == family
        for mode in ("online", "stream"):  # the features of the whole row on every rank: what does not fit
            with pytest.raises(UsageError, match=f"context_parallel is 2 with {mode} features.*extract.mode: offline"):
                parse_config({**base, "extract": {"mode": mode}, "train": {"context_parallel": 2,
                                                                          "draft": {"architecture": family}}})  # fmt: skip
    assert dist.context_group(1) is None
    with pytest.raises(UsageError, match="context_parallel is 2 but training runs on 1 process .not under torchrun"):
        dist.context_group(2)


def short_rows_worker(rank: int, world: int, port: int, out: str) -> None:
    from eaglekit.training import distributed as dist

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    context = dist.context_group(world)
    assert context is not None
    results = {}
    for length in SHORT:
        aux, ids, logits, loss_mask, attention, in_draft, _ = short_row(length)
        shard = context.shard(length, STEPS)
        inputs = (shard.inputs(aux), ids, shard.inputs(logits), loss_mask, attention, shard.inputs(in_draft), None)
        result, grads = step(drafter({}), inputs, "token", StepKernels(context=context))
        results[length] = {"loss": result.loss.detach(), "grads": grads, "piece": (shard.start, shard.end)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    end_ranks()


SHORT = (1, 2, 4, 5)


def short_row(length: int):
    return tuple(t[:, :length] if t is not None else None for t in batch(False))


def test_rows_shorter_than_the_ranks_leave_some_ranks_nothing(tmp_path):
    """3 ranks on rows of 1-5 positions: pieces of 1 or 2, the last ranks' empty; the sum is still the whole."""
    mp.spawn(short_rows_worker, args=(3, free_port(), str(tmp_path)), nprocs=3, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r[1]["piece"] for r in ranks] == [(0, 1), (1, 1), (1, 1)]
    for length in SHORT:
        single, grads = step(drafter({}), short_row(length), "token", StepKernels())
        parts = [r[length] for r in ranks]
        torch.testing.assert_close(sum(p["loss"] for p in parts), single.loss.detach(), rtol=1e-12, atol=1e-13)
        for param, grad in grads.items():
            got = sum(p["grads"][param] for p in parts if param in p["grads"])
            torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12, msg=f"{length} {param}")


# ------------------------------------------------------------------------------------- the block drafters

BLOCK = 4
BLOCK_CFG = dict(
    hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
    vocab_size=40, target_hidden_size=12, aux_layer_ids=[1, 2, 3], block_size=BLOCK, mask_token_id=39,
)  # fmt: skip
ANCHORS = 5  # of 11-13 candidates a row: a random draw, which every rank must make alike
# name: (family, sliding window, packed rows, position weighting, row length)
BLOCK_CASES = {
    "dflash_packed": ("dflash", None, True, "dpace", 17),
    "dflash_window": ("dflash", 5, True, "exp-decay", 17),
    "dspark_packed": ("dspark", None, True, "dpace", 17),
    "dspark_window": ("dspark", 5, False, "dpace", 17),
    "dflash_short": ("dflash", None, False, "dpace", 4),  # split 3 ways: pieces of 2, 2 and none
}


def block_drafter(family: str, window: int | None):
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
    from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter

    torch.manual_seed(0)
    if family == "dspark":
        return DSparkDrafter(DSparkConfig(**BLOCK_CFG, sliding_window=window, markov_rank=4)).double()
    return DFlashDrafter(DFlashConfig(**BLOCK_CFG, sliding_window=window)).double()


def block_batch(packed: bool, length: int):
    """2 rows (the second right-padded at 13), the target's logits over the whole vocabulary; packed rows hold the
    documents of ``batch``, which cross the boundaries of 2 ranks (9) and of 3 (6, 12)."""
    aux, ids, _, loss_mask, attention, _, positions = batch(packed)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, BLOCK_CFG["vocab_size"] - 1, ids.shape, generator=g)
    aux = torch.randn(*ids.shape, 3 * BLOCK_CFG["target_hidden_size"], generator=g, dtype=torch.float64)
    logits = torch.randn(*ids.shape, BLOCK_CFG["vocab_size"], generator=g, dtype=torch.float64)
    logits[..., :4] += 2.0  # a few likely tokens, so some drafts are right
    whole = (aux, ids, logits, loss_mask, attention, positions)
    return tuple(None if t is None else t[:, :length] for t in whole)


def block_step(name: str, seed: int, context=None):
    """One block_loss step of case ``name``: under ``context`` on this rank's share of the features; the anchors
    drawn by a generator of ``seed`` (the group takes its first rank's draw)."""
    from eaglekit.drafters.dflash.objective import block_loss

    family, window, packed, weighting, length = BLOCK_CASES[name]
    model = block_drafter(family, window)
    aux, ids, logits, loss_mask, attention, positions = block_batch(packed, length)
    if context is not None:
        shard = context.shard(length, BLOCK)
        aux, logits = shard.inputs(aux), shard.inputs(logits)
    out = block_loss(
        model, aux, logits.argmax(-1), ids, loss_mask, attention, positions, max_anchors=ANCHORS, weighting=weighting,
        generator=torch.Generator().manual_seed(seed), context=context,
    )  # fmt: skip
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    figures = {k: getattr(out, k).detach().clone() for k in ("counted", "correct", "accepted_run", "anchors")}
    return out.loss.detach(), figures, grads


def block_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from eaglekit.drafters.dflash.objective import BlockObjective
    from eaglekit.training import distributed as dist
    from eaglekit.training.context_parallel import ContextGroup

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    three = dist.context_group(3)
    pair = torch.distributed.new_group([0, 1])  # every rank makes it; ranks 0 and 1 split rows 2 ways in it
    assert three is not None
    results: dict = {3: {}, 2: {}}
    for name in BLOCK_CASES:  # each rank draws other anchors than its group's first: the group takes the first's
        results[3][name] = block_step(name, 11 + rank, three)
        if rank < 2:
            results[2][name] = block_step(name, 11 + rank, ContextGroup(pair, rank, 2))
    # the objective the training loop runs, under DDP over the 3 ranks (its gradients averaged), with anchors from
    # the global random stream, which differs per rank here
    objective = DDP(BlockObjective(block_drafter("dspark", 5), ANCHORS, "dpace", 0.5, 4.0, context=three))
    aux, ids, logits, loss_mask, attention, positions = block_batch(True, 17)
    shard = three.shard(17, objective.module.halo)
    torch.manual_seed(100 + rank)
    loss, _ = objective(shard.inputs(aux), ids, shard.inputs(logits.argmax(-1)), loss_mask, attention, None, positions)
    loss.backward()
    grads = {n.removeprefix("module."): p.grad.detach().clone() for n, p in objective.named_parameters()
             if p.grad is not None}  # fmt: skip
    results["ddp"] = {"loss": loss.detach(), "grads": grads}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    del objective
    end_ranks()


def test_block_drafters_split_rows_two_and_three_ways_equal_one_process(tmp_path):
    """DFlash and DSpark, packed documents across the ranks' boundaries, a sliding window, both weightings, a row
    of 17 (not divisible by 2 or 3) and one shorter than the ranks' pieces: the ranks' losses, figures and
    gradients add up to the single process's in fp64, and the training loop's objective under DDP gives its loss
    and gradients."""
    from eaglekit.drafters.dflash.objective import BlockObjective, select_anchors

    mp.spawn(block_worker, args=(3, free_port(), str(tmp_path)), nprocs=3, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for name, (_, _, packed, _, length) in BLOCK_CASES.items():
        loss, figures, grads = block_step(name, 11)
        assert "fc.weight" in grads and "layers.0.self_attn.k_proj.weight" in grads
        if name.startswith("dspark"):
            assert "markov_head.markov_w1.weight" in grads
        for size in (3, 2):
            parts = [r[size][name] for r in ranks[:size]]
            if length == 17:  # every rank owns blocks, and some block's labels lie past its rank's positions
                assert all(int(p[1]["anchors"]) > 0 for p in parts), f"{name} {size}"
                anchors, valid = select_anchors(block_batch(packed, length)[3] * block_batch(packed, length)[4],
                                                ANCHORS, torch.Generator().manual_seed(11))  # fmt: skip
                bounds = [-(-length // size) * r for r in range(1, size)]
                assert any(a < e <= a + BLOCK - 1 for a in anchors[valid].tolist() for e in bounds), name
            for key, value in figures.items():
                assert torch.equal(sum(p[1][key] for p in parts), value), f"{name} {size} {key}"
            torch.testing.assert_close(sum(p[0] for p in parts), loss, rtol=1e-12, atol=1e-13, msg=f"{name} {size}")
            assert set(grads) == set(parts[0][2])
            for param, grad in grads.items():
                got = sum(p[2][param] for p in parts)
                torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12, msg=f"{name} {size} {param}")

    single = BlockObjective(block_drafter("dspark", 5), ANCHORS, "dpace", 0.5, 4.0)
    aux, ids, logits, loss_mask, attention, positions = block_batch(True, 17)
    torch.manual_seed(100)
    loss, _ = single(aux, ids, logits.argmax(-1), loss_mask, attention, None, positions)
    loss.backward()
    # each rank's loss is its share times the group's size (which DDP's averaging divides out again)
    torch.testing.assert_close(sum(r["ddp"]["loss"] for r in ranks) / 3, loss.detach(), rtol=1e-12, atol=1e-13)
    for name, p in single.named_parameters():
        if p.grad is not None:
            for r in ranks:
                torch.testing.assert_close(r["ddp"]["grads"][name], p.grad, rtol=1e-10, atol=1e-12, msg=name)

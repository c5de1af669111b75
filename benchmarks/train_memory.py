"""Training benchmark: the memory model of `plan` and the train pre-flight (``training/memory.py``) against the
measured peak of real TTT steps, with and without ``train.ttt.activation_checkpointing``, and (``--context-parallel N``,
CPU) one rank's peak when N gloo ranks split the row (``train.context_parallel``) against the model's per-rank figure.

For each shape and row length it builds the drafter (EAGLE-3, Llama layer, EAGLE 3.1 flags), runs a warm step on a
short row (so that gradients and AdamW's moments exist), then one step on the full row, and reports the peak
memory of that step (CUDA: max_memory_allocated from an empty device, weights included; CPU: the process's peak
resident growth over the warm state, in a subprocess of its own) against the model's figure for the same part.
On the CPU each case's JSON also gives the peak and the end state of each phase (``phases``: forward, backward,
optimizer), so that a model part that is off can be told from the others. Prints one JSON line per case and a
table; asserts nothing.

    python benchmarks/train_memory.py                                   # CPU, H=256/512, rows 2K-8K, fp32
    python benchmarks/train_memory.py --device cuda --shape kimi --lengths 8192,16384,65536 --modes checkpointed
    python benchmarks/train_memory.py --context-parallel 2 --lengths 8192,16384      # CPU, 2 gloo ranks per row
    python benchmarks/train_memory.py --family dflash       # the block objective (training/block_memory.py), 512 anchors

``--family dflash`` / ``dspark``: the same measurement for a block drafter's step (the target's argmax computed in
chunks from its final hidden states as ``Features`` does for these families, inside the measured step), also with ``--context-parallel N``; it has
no activation checkpointing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.fused import step_kernels
from eaglekit.drafters.eagle3.memory import step_memory
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.training.context_parallel import ContextGroup

SHAPES = {
    # hidden, intermediate, heads, kv heads, head dim, target vocab, draft vocab
    "small": (256, 768, 4, 2, 64, 32000, 8192),
    "medium": (512, 1536, 8, 4, 64, 32000, 8192),
    "llama8b": (4096, 14336, 32, 8, 128, 128256, 32000),
    # Kimi-K2.5's drafter as a Llama layer at the target's width (docs/plan.md: "A Kimi-K2.5-sized plan")
    "kimi": (7168, 18432, 64, 64, 112, 163840, 32000),
}
STEPS = 7


def config(shape: str, max_len: int) -> DrafterConfig:
    h, i, heads, kv, hd, vocab, draft = SHAPES[shape]
    return DrafterConfig(
        hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=max(max_len, 4096),
        vocab_size=vocab, draft_vocab_size=draft, target_hidden_size=h, aux_layer_ids=None, fc_norm=True,
        norm_output=True,
    )  # fmt: skip


def run_case(shape: str, length: int, checkpoint: bool, device: str, context: ContextGroup | None = None) -> dict:
    """One case in this process: the measured peak (bytes) and the model's; with ``context``, this rank's share."""
    cfg = config(shape, length)
    ranks = 1 if context is None else context.size
    dev = torch.device(device)
    bf16 = dev.type == "cuda"
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    drafter = Eagle3Drafter(cfg).to(dev)
    drafter.lm_head.weight.requires_grad_(False)  # train.freeze_lm_head's default
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_frozen = sum(p.numel() for p in drafter.parameters()) - n_trainable
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    kernels = step_kernels("auto", "auto", dev, checkpoint, context)
    store = torch.bfloat16 if bf16 else torch.float32

    phases: dict[str, int] = {}  # CPU, the measured step: each phase's peak resident growth over the warm state
    warm: list[int] = []  # the warm state's resident bytes, once the measured step begins

    def mark(phase: str) -> None:
        if warm:
            phases[phase] = _status_bytes("VmHWM") - warm[0]
            phases[phase + "_end"] = _status_bytes("VmRSS") - warm[0]
            Path("/proc/self/clear_refs").write_text("5")  # the next phase's peak counts from here

    def step(n: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(n)
        rows = n if context is None else (lambda s: s.stop - s.start)(context.shard(n, STEPS))  # its share and halo
        aux = torch.randn(1, rows, 3 * cfg.target_hidden_size, generator=g).to(dev, store)
        last = torch.randn(1, rows, cfg.target_hidden_size, generator=g).to(dev, store)
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g).to(dev)
        with torch.no_grad():  # the target's logits over the draft vocabulary, from its final state (offline)
            logits = (last @ drafter.lm_head.weight.to(store).T).to(store)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = ttt_loss(
                drafter, aux, ids, logits, torch.ones_like(ids), settings=TTTConfig(steps=STEPS), kernels=kernels
            )
        mark("forward")
        out.loss.backward()
        mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")

    step(256)  # warm: gradients and AdamW's moments exist, kernels compiled
    gc.collect()
    model = step_memory(cfg, length, STEPS, trainable=n_trainable, frozen=n_frozen, checkpoint=checkpoint, bf16=bf16,
                        device_type=dev.type, context_parallel=ranks)  # fmt: skip
    t0 = time.monotonic()
    if dev.type == "cuda":
        measured, predicted = cuda_peak(step, length), model.total
    else:  # the growth over the warm state: weights and optimizer state are already there
        Path("/proc/self/clear_refs").write_text("5")
        warm.append(_status_bytes("VmRSS"))
        step(length)
        measured = max(phases["forward"], phases["backward"], phases["optimizer"])
        predicted = model.total - model.weights
    seconds = time.monotonic() - t0
    return {
        "shape": shape, "length": length, "checkpointing": checkpoint, "device": device, "context_parallel": ranks,
        "measured_bytes": int(measured), "model_bytes": int(predicted), "ratio": round(measured / predicted, 4),
        "model_parts": {k: getattr(model, k) for k in ("weights", "batch", "activations", "gathered", "transient")},
        "kept_per_token": round(model.per_token), "step_seconds": round(seconds, 2), "phases": phases,
    }  # fmt: skip


BLOCK_LAYERS, BLOCK_SIZE, BLOCK_ANCHORS = 5, 16, 512  # speculators' DFlash recipe


def run_block_case(family: str, shape: str, length: int, device: str, context: ContextGroup | None = None) -> dict:
    """One block-drafter case in this process: the measured peak of a step (bytes) and the model's; with ``context``,
    this rank's (its share of the row's features and a block's halo, as ``ContextGroup.cut`` leaves them)."""
    from eaglekit.drafters.dflash.memory import block_step_memory
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
    from eaglekit.drafters.dflash.objective import BlockObjective
    from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
    from eaglekit.model.target import target_argmax

    h, i, heads, kv, hd, vocab, _ = SHAPES[shape]
    cls, drafter_cls = (DSparkConfig, DSparkDrafter) if family == "dspark" else (DFlashConfig, DFlashDrafter)
    cfg = cls(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
              num_hidden_layers=BLOCK_LAYERS, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
              max_position_embeddings=max(length, 4096), vocab_size=vocab, target_hidden_size=h,
              aux_layer_ids=[1, 2, 3], block_size=BLOCK_SIZE, mask_token_id=0)  # fmt: skip
    dev = torch.device(device)
    bf16 = dev.type == "cuda"
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    drafter = drafter_cls(cfg).to(dev)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_frozen = sum(p.numel() for p in drafter.parameters()) - n_trainable
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    objective = BlockObjective(drafter, BLOCK_ANCHORS, "dpace", 0.5, 4.0, context=context)
    ranks = 1 if context is None else context.size
    store = torch.bfloat16 if bf16 else torch.float32

    def step(n: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(n)
        shard = None if context is None else context.shard(n, BLOCK_SIZE)
        held = n if shard is None else shard.stop - shard.start
        aux = torch.randn(1, held, 3 * h, generator=g).to(dev, store)
        last = torch.randn(1, held, h, generator=g).to(dev, store)
        ids = torch.randint(0, vocab, (1, n), generator=g).to(dev)
        argmax = target_argmax(last, drafter.lm_head.weight.to(store))  # as Features does for the block families
        del last
        ones = torch.ones_like(ids)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = objective(aux, ids, argmax, ones, ones)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(256)  # warm: gradients and AdamW's moments exist
    gc.collect()
    model = block_step_memory(cfg, length, 1, BLOCK_ANCHORS, trainable=n_trainable, frozen=n_frozen, bf16=bf16,
                              context_parallel=ranks)  # fmt: skip
    t0 = time.monotonic()
    if dev.type == "cuda":
        measured, predicted = cuda_peak(step, length), model.total
    else:
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_bytes("VmRSS")
        step(length)
        measured, predicted = _status_bytes("VmHWM") - base, model.total - model.weights
    return {
        "family": family, "shape": shape, "length": length, "checkpointing": False, "device": device,
        "context_parallel": ranks,
        "measured_bytes": int(measured), "model_bytes": int(predicted), "ratio": round(measured / predicted, 4),
        "model_parts": {k: getattr(model, k) for k in ("weights", "batch", "activations", "gathered", "transient")},
        "kept_per_token": round(model.per_token), "step_seconds": round(time.monotonic() - t0, 2),
    }  # fmt: skip


def block_context_case(family: str, shape: str, length: int, ranks: int) -> dict:
    """One CPU block-drafter case on ``ranks`` gloo processes splitting the row: the rank with the highest peak."""
    return on_ranks(ranks, run_block_case, family, shape, length)


def context_case(shape: str, length: int, checkpoint: bool, ranks: int) -> dict:
    """One CPU case on ``ranks`` gloo processes splitting the row: the rank with the highest measured peak."""
    return on_ranks(ranks, run_case, shape, length, checkpoint)


def on_ranks(ranks: int, case, *args) -> dict:
    """``case(*args, "cpu", context_group)`` on ``ranks`` gloo processes: the row of the rank with the highest peak."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_case, args=(ranks, port, out, case, args), nprocs=ranks, join=True)
        rows = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
    return max(rows, key=lambda r: r["measured_bytes"])


def _rank_case(rank: int, ranks: int, port: int, out: str, case, args: tuple) -> None:
    from eaglekit.training import distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    dist.init()
    row = case(*args, "cpu", dist.context_group(ranks))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({**row, "rank": rank}))
    dist.barrier()
    torch.distributed.destroy_process_group()


def cuda_peak(step, length: int) -> int:
    """The allocator's peak over one step of ``length`` tokens (the weights and optimizer state included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(length)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="small,medium", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--modes", default="plain,checkpointed")
    p.add_argument("--context-parallel", type=int, default=1, help="CPU: gloo ranks splitting each row")
    p.add_argument("--family", default="eagle3", choices=("eagle3", "dflash", "dspark"))
    p.add_argument("--json", help="also append each case's JSON line to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # one CPU case in a fresh process: nothing else this process allocated blurs its peak
        shape, length, mode, ranks = args.child.split(":")
        if args.family != "eagle3" and int(ranks) > 1:
            print(json.dumps(block_context_case(args.family, shape, int(length), int(ranks))))
        elif args.family != "eagle3":
            print(json.dumps(run_block_case(args.family, shape, int(length), "cpu")))
        elif int(ranks) > 1:
            print(json.dumps(context_case(shape, int(length), mode == "checkpointed", int(ranks))))
        else:
            print(json.dumps(run_case(shape, int(length), mode == "checkpointed", "cpu")))
        return
    if args.context_parallel > 1 and args.device != "cpu":
        p.error("--context-parallel measures gloo ranks on the CPU; on GPUs train under torchrun instead")
    modes = args.modes.split(",") if args.family == "eagle3" else ["plain"]  # no activation checkpointing
    rows = []
    for shape in args.shape.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            for mode in modes:
                try:
                    if args.device == "cpu":
                        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed memory goes back to the OS
                        case = f"{shape}:{length}:{mode}:{args.context_parallel}"
                        out = subprocess.run([sys.executable, __file__, "--child", case, "--family", args.family],
                                             env=env, capture_output=True, text=True, check=True)  # fmt: skip
                        row = json.loads(out.stdout.strip().splitlines()[-1])
                    elif args.family != "eagle3":
                        row = run_block_case(args.family, shape, length, args.device)
                    else:
                        row = run_case(shape, length, mode == "checkpointed", args.device)
                except (RuntimeError, subprocess.CalledProcessError, torch.OutOfMemoryError) as err:
                    text = getattr(err, "stderr", None) or str(err)
                    row = {"shape": shape, "length": length, "checkpointing": mode == "checkpointed",
                           "error": text.strip().splitlines()[-1][:300]}  # fmt: skip
                    if args.device != "cpu":
                        torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(f"\n{'shape':8} {'L':>7} {'mode':13} {'measured':>10} {'model':>10} {'ratio':>6}"
          + (f"   (one of {args.context_parallel} ranks per row)" if args.context_parallel > 1 else ""))  # fmt: skip
    for r in rows:
        mode = "checkpointed" if r["checkpointing"] else "plain"
        if "error" in r:
            print(f"{r['shape']:8} {r['length']:>7} {mode:13} {r['error']}")
        else:
            gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
            print(f"{r['shape']:8} {r['length']:>7} {mode:13} {gb(r['measured_bytes']):>10} "
                  f"{gb(r['model_bytes']):>10} {r['ratio']:>6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""extract (offline mode only): run the frozen target once over the prepared tokens and store its features.

Reads ``prepare/tokens.safetensors``; writes ``extract/shard-NNNNN.safetensors`` (aux hidden states
[T, 3Ht] and the final normed hidden state [T, Ht] per token, see ``eaglekit.data.shards``) with a sidecar
each, and ``extract/index.json`` at the end. The final hidden state is stored instead of logits (Ht numbers
per token rather than Vd): the train stage applies the target's lm_head itself.

Resumable shard by shard: the shard plan is a function of the token store and ``extract.shard_tokens``,
so a killed run skips the shards that have a sidecar and a file of the recorded size. Under torchrun,
rank r extracts shards r, r+world, ...; rank 0 writes the index once all ranks are done.
"""

from __future__ import annotations

import json
import os

import torch

from eaglekit.config import RunConfig
from eaglekit.data import shards as sh
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.model.target import (TargetFeatures, aux_layer_ids, load_target, target_hf_config, target_identity,
                                   text_config)
from eaglekit.preflight import checks as common
from eaglekit.preflight import disk, environment, files, gpus
from eaglekit.preflight import fail, ok, skip
from eaglekit.preflight.checks import human_bytes
from eaglekit.progress import Meter, console
from eaglekit.training import distributed
from eaglekit.training.data import pad

NAME = "extract"
UPSTREAM = "vocab"  # needs only prepare's tokens; "vocab" keeps the chain linear
FULL_SHA_LIMIT = 64 << 30  # pre-flight re-hashes existing shards up to this many bytes; beyond, sizes only


def params(cfg: RunConfig) -> dict:
    return {**cfg.extract.model_dump(exclude={"mode"}), "target": target_identity(cfg.target)}


def _plan(ctx):
    store = TokenStore(ctx.run.stage_dir("prepare") / "tokens.safetensors")
    lengths = store.lengths.tolist()
    return store, lengths, sh.plan_shards(lengths, ctx.cfg.extract.shard_tokens)


def _shard_meta(hidden: int, aux_ids: list[int], dtype: str) -> dict:
    return {"hidden_size": hidden, "aux_layer_ids": json.dumps(aux_ids), "dtype": dtype}


def estimate_bytes(ctx) -> int | None:
    """Exact shard sizes of the plan (header, features, offsets) plus sidecars and index; on resume, what is left."""
    if not (ctx.run.stage_dir("prepare") / "tokens.safetensors").exists():
        return None
    store, lengths, plan = _plan(ctx)
    hf = target_hf_config(ctx.cfg.target)
    meta = _shard_meta(hf.hidden_size, aux_layer_ids(ctx.cfg.target, hf.num_hidden_layers), ctx.cfg.extract.dtype)
    dtype = getattr(torch, ctx.cfg.extract.dtype)
    total = 0
    for n, samples in enumerate(plan):
        if ctx.resuming and sh.complete_shard(ctx.dir / sh.shard_name(n)):
            continue
        total += sh.shard_bytes([store.ids[i] for i in samples], sum(lengths[i] for i in samples), hf.hidden_size,
                                dtype, meta) + 512
    return total + 4096 + 256 * len(plan)


def existing_shards(ctx):
    """When resuming, the shards already written must match their sidecars (size always, sha256 when affordable)."""
    if not ctx.resuming or not any(ctx.dir.glob("shard-*.json")):
        return skip("existing shards", "nothing to resume")
    total = sum(p.stat().st_size for p in ctx.dir.glob("shard-*.safetensors"))
    full = total <= FULL_SHA_LIMIT
    good, problems = sh.validate_shards(ctx.dir, full_sha=full)
    if problems:
        return fail("existing shards", f"{len(problems)} damaged: " + "; ".join(problems[:5]), sh.REMEDY)
    how = "size and sha256" if full else f"size only (sha256 skipped above {human_bytes(FULL_SHA_LIMIT)})"
    return ok("existing shards", f"{len(good)} complete shards ({human_bytes(total)}) verified by {how}; resuming after them")


def damaged(ctx) -> str | None:
    """A finished extract whose shard was deleted or cut short (say, to repair it) is rerun: it re-extracts only that."""
    try:
        shards = json.loads((ctx.dir / sh.INDEX).read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return f"{ctx.dir / sh.INDEX} is missing or unreadable"
    for entry in shards:
        if sh.complete_shard(ctx.dir / entry["file"]) is None:
            return f"shard {entry['file']} is missing or not the size its sidecar records"
    return None


def target_placement(ctx):
    """Under torchrun every rank loads its own copy of the target onto its own GPU; device_map would spread
    each rank's copy over all GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and ctx.cfg.target.device_map:
        return fail("target placement", f"target.device_map is '{ctx.cfg.target.device_map}' under torchrun with "
                                        f"{world} processes: each would spread its own copy over every GPU",
                    "unset target.device_map (one copy per GPU), or run a single process with device_map to shard "
                    "a target too big for one GPU")
    where = f"one copy per process ({world})" if world > 1 else (ctx.cfg.target.device_map or "one device")
    return ok("target placement", where)


def checks(cfg: RunConfig) -> list:
    return [common.target_folder, files.target_weights, environment.software, environment.devices, gpus.gpus,
            target_placement, existing_shards, disk.write_rate]


def estimate_files(ctx) -> int | None:
    """Inodes: a shard and its sidecar per ``extract.shard_tokens`` tokens, and the index."""
    if not (ctx.run.stage_dir("prepare") / "tokens.safetensors").exists():
        return None
    return 2 * len(_plan(ctx)[2]) + 2


def estimate_write_rate(ctx) -> tuple[float, str] | None:
    """Bytes per second the features arrive at: the target's forward speed that an earlier extract of this run
    measured (a pilot), times the bytes stored per token."""
    end = (ctx.run.last_events().get(NAME) or {}).get("end") or {}
    rate = (end.get("counts") or {}).get("tokens_per_s")
    if not rate:
        return None
    hidden = target_hf_config(ctx.cfg.target).hidden_size
    per_token = sh.bytes_per_token(hidden, ctx.cfg.extract.dtype)
    return rate * per_token, f"{rate:,.0f} tok/s measured by the last extract × {per_token:,} B/token"


@torch.no_grad()
def run(ctx) -> dict:
    cfg = ctx.cfg
    distributed.init()
    distributed.barrier()  # rank 0 has passed its pre-flight (and --force's cleanup) before any rank looks at shards
    rank, world = distributed.rank(), distributed.world_size()
    store, lengths, plan = _plan(ctx)
    model = load_target(cfg.target, distributed.device())
    n_layers = text_config(model.config).num_hidden_layers
    aux_ids = aux_layer_ids(cfg.target, n_layers)
    target = TargetFeatures(model, aux_ids)
    hidden, dtype = target.hidden_size, getattr(torch, cfg.extract.dtype)
    meta = _shard_meta(hidden, aux_ids, cfg.extract.dtype)

    mine = list(range(rank, len(plan), world))
    done = {n for n in mine if sh.complete_shard(ctx.dir / sh.shard_name(n))}
    shard_tokens = {n: sum(lengths[i] for i in plan[n]) for n in mine}
    if done:
        console.print(f"extract: rank {rank}: {len(done)} of {len(mine)} shards already complete, resuming after them")
    with Meter(f"extract (rank {rank})" if world > 1 else "extract", total=sum(shard_tokens.values()), unit="tok",
               initial=sum(shard_tokens[n] for n in done)) as meter:
        for n in mine:
            if n in done:
                continue
            samples = plan[n]
            slot = {i: j for j, i in enumerate(samples)}
            with sh.ShardWriter(ctx.dir / sh.shard_name(n), [store.ids[i] for i in samples],
                                [lengths[i] for i in samples], hidden, dtype, meta) as writer:
                for batch in sh.plan_batches(samples, lengths, cfg.extract.batch_tokens):
                    ids = [store[i][1] for i in batch]
                    input_ids = pad(ids)
                    mask = pad([torch.ones_like(t) for t in ids])
                    feats = target(input_ids, mask, with_logits=False)
                    aux, last = feats.aux.cpu(), feats.last_hidden.cpu()
                    for b, i in enumerate(batch):
                        writer.write(slot[i], aux[b, : lengths[i]], last[b, : lengths[i]])
                    meter.update(sum(lengths[i] for i in batch), shard=f"{n + 1}/{len(plan)}")

    distributed.barrier()
    counts = {}
    if distributed.is_main():
        entries = [sh.complete_shard(ctx.dir / sh.shard_name(n)) for n in range(len(plan))]
        missing = [sh.shard_name(n) for n, e in enumerate(entries) if e is None]
        if missing:
            raise EaglekitError(f"extract: {len(missing)} shards are missing or damaged after the run, e.g. {missing[0]}",
                                "rerun `eaglekit extract CONFIG`; it re-extracts only those")
        sh.write_index(ctx.dir, entries, {"hidden_size": hidden, "aux_layer_ids": aux_ids, "dtype": cfg.extract.dtype,
                                          "target": cfg.target.model})
        index = json.loads((ctx.dir / sh.INDEX).read_text())
        counts = {"shards": len(entries), "samples": index["samples"], "tokens": index["tokens"],
                  "bytes": index["bytes"], "tokens_per_s": round(meter.rate, 1)}
        console.print(f"extract: {counts['shards']} shards, {counts['tokens']} tokens, {human_bytes(counts['bytes'])}")
    distributed.barrier()
    return counts

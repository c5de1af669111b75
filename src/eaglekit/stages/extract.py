"""extract (offline mode only): the target's hidden states for every prepared sample, to disk.

Reads ``prepare/tokens.safetensors``; writes ``extract/shard-NNNNN.safetensors`` (per token: three aux
hidden states and the final normed hidden state, in ``extract.dtype``: bfloat16, or fp8 at half the
bytes — see ``eaglekit.data.shards``), a ``.json`` sidecar per shard, and ``extract/index.json`` at the
end. The final hidden state is stored instead of logits (Ht numbers per token rather than Vd): the train
stage applies the target's lm_head itself.

Two feature sources (``extract.backend``):
  hf    the target in this process (transformers), batch by batch;
  vllm  running vLLM servers started with the ``extract_hidden_states`` method (``eaglekit serve-command
        CONFIG`` prints the command): each sample is sent as token ids with max_tokens 1, many in flight
        over all servers (``eaglekit.serving.vllm_features``).
(``extract.mode: stream`` runs no extract: train asks the same servers for each batch as it goes, through the
same client; ``eaglekit.training.stream``.) Either way the rows go to a background writer (``eaglekit.data.shard_sink``) so computing and writing
overlap; the stage reports both rates and which one limited it.

Resumable shard by shard: the shard plan is a function of the token store and ``extract.shard_tokens``,
so a killed run redoes only the shards without a sidecar (a shard is committed — temp file, fsync,
rename, then its sidecar with sha256 — or absent). Under torchrun, rank r extracts shards r, r+world,
...; rank 0 writes the index once all ranks are done.

Grown data: when only the prepared tokens changed (samples added, removed or edited), the stage goes on from the
shards it has (``continues``): a shard whose every sample has the same tokens as when it was written
(``extract/samples.json``) is kept, the other samples go to new shards numbered after the old ones
(``extract/continued.json`` holds that plan, so a killed run resumes it), and the index lists each sample once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext
from eaglekit.data import shard_files as sh
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.preflight import disk, fail, files, gpus, ok, run_directory, skip
from eaglekit.progress import Meter, console, human_bytes
from eaglekit.resolved import ResolvedRun
from eaglekit.serving.client import RequestFailed

if TYPE_CHECKING:
    from eaglekit.model.target import TargetFeatures

NAME = "extract"
UPSTREAM = "vocab"  # needs only prepare's tokens; "vocab" keeps the chain linear
FULL_SHA_LIMIT = 64 << 30  # pre-flight re-hashes existing shards up to this many bytes; beyond, sizes only


def params(run: ResolvedRun) -> dict:
    """What the shards depend on: not the servers, concurrency or writer queue (adding a server must not
    invalidate finished shards)."""
    cfg = run.cfg
    e = cfg.extract
    p = {
        "backend": e.backend,
        "dtype": e.dtype,
        "shard_tokens": e.shard_tokens,
        **files.read_identities(cfg, "target", "tokens"),
        "format": sh.VERSION,
    }  # shards of another storage format are another stage's outputs (--force replaces them)
    if e.backend == "hf":
        p["batch_tokens"] = e.batch_tokens  # padding changes the numerics a little
    return p


def live_counts(stage_dir: Path) -> dict:
    """What `status` shows while extract runs or after it was killed: the shards committed so far."""
    found = (sh.complete_shard(side.with_suffix(".safetensors")) for side in stage_dir.glob("shard-*.json"))
    entries = [e for e in found if e]
    return {
        "shards_committed": len(entries),
        "samples": sum(e["samples"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
    }


def _plan(ctx: StageContext):
    """The token store, its lengths and the samples (store indices) of each shard by its number: the shard plan
    over all samples, or the plan of an extract that goes on from another's shards (``CONTINUED``)."""
    store = _token_store(ctx)
    lengths = store.lengths.tolist()
    continued = _read_json(ctx.dir / CONTINUED)
    if continued and continued.get("fingerprint") == ctx.fingerprint:
        return store, lengths, {int(n): samples for n, samples in continued["shards"].items()}
    return store, lengths, dict(enumerate(sh.plan_shards(lengths, ctx.cfg.extract.shard_tokens)))


def _token_store(ctx: StageContext):
    return TokenStore(ctx.run.stage_dir("prepare") / "tokens.safetensors")


def _read_json(path: Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


# ------------------------------------------------------------------------------------------- grown data

SAMPLE_TOKENS = "samples.json"  # each sample's token hash when its shards were written, and for which fingerprint
CONTINUED = "continued.json"  # the shard plan of an extract that goes on from another's shards


def token_hashes(store) -> dict[str, str]:
    """Each sample's token ids, hashed: a sample's features are a function of them (and of the target)."""
    return {
        sid: hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        for sid, ids, _ in (store[i] for i in range(len(store)))
    }


def reusable(ctx: StageContext, store) -> tuple[dict[int, list[int]], list[int]] | None:
    """The shards in the folder whose every sample is still prepared with the same tokens (their number → store
    indices), and the store indices left to extract; None when the folder does not say what its shards hold."""
    index, made = _read_json(ctx.dir / sh.INDEX), _read_json(ctx.dir / SAMPLE_TOKENS)
    if not index or not made or not isinstance(made.get("samples"), dict):
        return None
    now, position = token_hashes(store), {sid: i for i, sid in enumerate(store.ids)}
    kept = {
        int(entry["file"].removeprefix("shard-").removesuffix(".safetensors")): [position[sid] for sid in entry["ids"]]
        for entry in index.get("shards") or []
        if all(sid in now and now[sid] == made["samples"].get(sid) for sid in entry["ids"])
        and sh.complete_shard(ctx.dir / entry["file"])
    }
    covered = {i for samples in kept.values() for i in samples}
    return kept, [i for i in range(len(store)) if i not in covered]


def continues(ctx: StageContext) -> str | None:
    """Only the prepared tokens changed since the shards in the folder were written (prepare went on with samples
    added, removed or edited): the shards whose every sample is unchanged are kept, and only the other samples are
    extracted, into new shards. None (replaced, only with --force) when no shard can be kept."""
    if not files.changed_only(ctx, ("tokens",)):
        return None
    try:
        store = _token_store(ctx)
    except EaglekitError:
        return None  # the upstream check names it
    found = reusable(ctx, store)
    if not found or not found[0]:
        return None
    kept, rest = found
    return (
        f"the prepared tokens changed since it ran: {len(rest)} new samples to extract of {len(store)}; "
        f"{len(store) - len(rest)} reused ({len(kept)} shard{'s' * (len(kept) > 1)} kept)"
    )


def go_on_from_other_shards(ctx: StageContext) -> None:
    """Rank 0, before any rank plans: when the folder holds another extraction's shards that ``continues`` goes on
    from, fix the plan (the shards kept, and new shards numbered after every old one for the other samples) in
    ``CONTINUED``, then remove the shards no sample of which is kept as it was, and the old index."""
    made = _read_json(ctx.dir / SAMPLE_TOKENS)
    if not made or made.get("fingerprint") == ctx.fingerprint:
        return
    store = _token_store(ctx)
    found = reusable(ctx, store)
    if found is None:
        return
    kept, rest = found
    lengths = store.lengths.tolist()
    numbers = [int(p.stem.removeprefix("shard-")) for p in ctx.dir.glob("shard-*.json")]
    first = max(numbers, default=-1) + 1
    planned = sh.plan_shards([lengths[i] for i in rest], ctx.cfg.extract.shard_tokens) if rest else []
    new = {first + k: [rest[j] for j in shard] for k, shard in enumerate(planned)}
    atomic.write_json(
        ctx.dir / CONTINUED, {"fingerprint": ctx.fingerprint, "shards": {str(n): v for n, v in (kept | new).items()}}
    )
    for n in numbers:
        if n not in kept:
            sh.sidecar_path(ctx.dir / sh.shard_name(n)).unlink(missing_ok=True)  # the sidecar first: never a
            (ctx.dir / sh.shard_name(n)).unlink(missing_ok=True)  # complete-looking shard without its features
    (ctx.dir / sh.INDEX).unlink(missing_ok=True)
    (ctx.dir / SAMPLE_TOKENS).unlink(missing_ok=True)
    console.print(f"extract: {len(rest)} new samples, {len(store) - len(rest)} reused")


def _shard_meta(hidden: int, aux_ids: list[int], backend: str) -> dict:
    return {
        "hidden_size": hidden,
        "aux_layer_ids": json.dumps(aux_ids),
        "backend": backend,
        "last_hidden": "after the target's final norm",
    }


def estimate_bytes(ctx: StageContext) -> int | None:
    """Exact shard sizes of the plan (header, features, offsets) plus sidecars and index; on resume, what is left."""
    if not (ctx.run.stage_dir("prepare") / "tokens.safetensors").exists():
        return None
    store, lengths, plan = _plan(ctx)
    hf, aux = ctx.resolved.target_and_aux
    meta = _shard_meta(hf.hidden_size, aux, ctx.cfg.extract.backend)
    total = 0
    for n, samples in plan.items():
        if ctx.resuming and sh.complete_shard(ctx.dir / sh.shard_name(n)):
            continue
        ids = [store.ids[i] for i in samples]
        sidecar = 512 + sum(len(json.dumps(s)) + 12 for s in ids)  # the sidecar (and its copy in the index)
        total += (
            sh.shard_bytes(ids, sum(lengths[i] for i in samples), hf.hidden_size, ctx.cfg.extract.dtype, meta)
            + 2 * sidecar
        )
    return total + 4096


# ------------------------------------------------------------------------------------------- pre-flight


def existing_shards(ctx: StageContext):
    """When resuming, the shards already written must match their sidecars: size always, sha256 when affordable
    (cached: a shard read back once is not rehashed). A shard whose bytes differ from its sha256 is re-extracted."""
    if not ctx.resuming or not any(ctx.dir.glob("shard-*.json")):
        return skip("existing shards", "nothing to resume")
    total = sum(p.stat().st_size for p in ctx.dir.glob("shard-*.safetensors"))
    full = total <= FULL_SHA_LIMIT
    sized, problems = sh.validate_shards(ctx.dir, full_sha=False)
    if problems:
        return fail("existing shards", f"{len(problems)} damaged: " + "; ".join(problems[:5]), sh.REMEDY)
    if full:
        differ = sh.verify_contents(ctx.dir, [e["file"] for e in sized])[0]
    else:  # what an earlier read-back (train's pre-flight) found
        differ = [m for m in (sh.known_mismatch(ctx.dir / e["file"]) for e in sized) if m is not None]
    how = "size and sha256" if full else f"size only (sha256 skipped above {human_bytes(FULL_SHA_LIMIT)})"
    redo = f"; {len(differ)} whose bytes differ from their sha256 are re-extracted: {differ[0]}" if differ else ""
    return ok(
        "existing shards",
        f"{len(sized) - len(differ)} complete shards ({human_bytes(total)}) verified by {how}; resuming after "
        f"them{redo}",
    )


def damaged(ctx: StageContext) -> str | None:
    """A finished extract whose shard was deleted or cut short (say, to repair it), or whose bytes a read-back
    found to differ from their sha256 (train's pre-flight), is rerun: it re-extracts only that shard. Checked
    without hashing (sizes, the digests read back before, and the sidecar's sha256 against the index's): a shard
    counts as present once its sidecar does, so a shard the index lists but whose sidecar is gone is redone too."""
    try:
        shards = json.loads((ctx.dir / sh.INDEX).read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return f"{ctx.dir / sh.INDEX} is missing or unreadable"
    cache = sh.read_digest_cache(ctx.dir)
    for entry in shards:
        differ = sh.known_mismatch(ctx.dir / entry["file"], cache)
        if differ is not None:
            return f"shard {differ}"
        found = sh.complete_shard(ctx.dir / entry["file"])
        if found is None:
            return f"shard {entry['file']} or its sidecar is missing, or the shard is not the size its sidecar records"
        if found.get("sha256") != entry.get("sha256"):
            return f"shard {entry['file']}'s sidecar is not the one {sh.INDEX} lists (another extraction's shard)"
    return None


def kept(ctx: StageContext) -> str:
    """What a stopped extract leaves: committed shards (an open one is a temp file, dropped on resume)."""
    counts = live_counts(ctx.dir)
    if not counts["shards_committed"]:
        return "no shard committed yet (a rerun starts over)"
    return (
        f"{counts['shards_committed']} committed shards ({counts['samples']} samples, {counts['tokens']} tokens) "
        f"in {ctx.dir} (a rerun resumes after them)"
    )


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight import environment  # lazy: heavy (torch)
    from eaglekit.preflight.feature_servers import (  # lazy: heavy (torch)
        feature_servers,
        feature_smoke,
        feature_storage,
    )

    if cfg.extract.backend == "vllm":  # the servers compute: no local devices to check, the servers instead
        return [
            run_directory.target_folder,
            files.target_weights,
            environment.software,
            feature_servers,
            feature_storage,
            existing_shards,
            feature_smoke,
            disk.write_rate,
        ]
    return [
        run_directory.target_folder,
        files.target_weights,
        environment.software,
        environment.devices,
        gpus.gpus,
        gpus.target_placement,
        existing_shards,
        disk.write_rate,
    ]


def estimate_files(ctx: StageContext) -> int | None:
    """Inodes: a shard and its sidecar per ``extract.shard_tokens`` tokens, and the index."""
    if not (ctx.run.stage_dir("prepare") / "tokens.safetensors").exists():
        return None
    return 2 * len(_plan(ctx)[2]) + 2


def estimate_write_rate(ctx: StageContext) -> tuple[float, str] | None:
    """Bytes per second the features arrive at: the target's forward speed that an earlier extract of this run
    measured (a pilot), times the bytes stored per token."""
    end = (ctx.run.last_events().get(NAME) or {}).get("end") or {}
    rate = (end.get("counts") or {}).get("tokens_per_s")
    if not rate:
        return None
    hidden = ctx.resolved.target_and_aux[0].hidden_size
    per_token = sh.bytes_per_token(hidden, ctx.cfg.extract.dtype)
    return rate * per_token, f"{rate:,.0f} tok/s measured by the last extract × {per_token:,} B/token"


# ------------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    import torch  # lazy: heavy (torch)

    with torch.no_grad():
        return _run(ctx)


def _run(ctx: StageContext) -> dict:
    from eaglekit.data.shard_sink import ShardSink  # lazy: heavy (torch)
    from eaglekit.model.target import TargetFeatures, load_target, read_final_norm  # lazy: heavy (torch)
    from eaglekit.training import distributed  # lazy: heavy (torch)

    cfg = ctx.cfg
    distributed.init()
    if distributed.is_main():
        go_on_from_other_shards(ctx)
    distributed.barrier()  # rank 0 has passed its pre-flight (and --force's cleanup) before any rank looks at shards
    rank, world = distributed.rank(), distributed.world_size()
    store, lengths, plan = _plan(ctx)
    hf, aux_ids = ctx.resolved.target_and_aux
    n_layers, hidden = hf.num_hidden_layers, hf.hidden_size
    dtype, backend = cfg.extract.dtype, cfg.extract.backend
    meta = _shard_meta(hidden, aux_ids, backend)

    mine = sorted(plan)[rank::world]
    done = {n for n in mine if sh.complete_shard(ctx.dir / sh.shard_name(n))}
    todo = [n for n in mine if n not in done]
    for n in todo:  # what a killed run left of its open shards: temp files, never a visible shard
        for tmp in ctx.dir.glob(f".{sh.shard_name(n).removesuffix('.safetensors')}.*.tmp"):
            tmp.unlink(missing_ok=True)
    shard_tokens = {n: sum(lengths[i] for i in plan[n]) for n in mine}
    if done:
        grown = "kept from before the data changed, extracting the others" if (ctx.dir / CONTINUED).exists() else ""
        said = grown or "already complete, resuming after them"
        console.print(f"extract: rank {rank}: {len(done)} of {len(mine)} shards {said}")
    writes = {n: ([store.ids[i] for i in plan[n]], [lengths[i] for i in plan[n]]) for n in todo}
    # the feature source is ready before the clock starts: the target loaded, or the final norm read
    target = (
        TargetFeatures(load_target(cfg.target, distributed.device()), aux_ids) if backend == "hf" and todo else None
    )
    norm = read_final_norm(cfg.target) if backend == "vllm" and todo else None
    if target is not None:
        capture_self_check(target, store, lengths, [i for n in todo for i in plan[n]])
    label = f"extract (rank {rank})" if world > 1 else "extract"
    with Meter(
        label, total=sum(shard_tokens.values()), unit="tok", initial=sum(shard_tokens[n] for n in done)
    ) as meter:
        with ShardSink(ctx.dir, writes, hidden, dtype, meta, depth=cfg.extract.writer_queue) as sink:
            if backend == "vllm" and todo:
                _extract_vllm(ctx, norm, store, plan, todo, sink, meter, aux_ids, n_layers, hidden)
            elif target is not None:  # backend hf with shards to do
                _extract_hf(cfg, target, store, lengths, plan, todo, sink, meter)
        rates = sink.report(sum(shard_tokens[n] for n in todo))
    if todo:
        print_rates(rates, backend, f" (rank {rank})" if world > 1 else "")
    distributed.barrier()
    counts = {}
    if distributed.is_main():
        counts = write_index(ctx, sorted(plan), hidden, aux_ids, meter.rate, rates if todo else None)
        atomic.write_json(ctx.dir / SAMPLE_TOKENS, {"fingerprint": ctx.fingerprint, "samples": token_hashes(store)})
        (ctx.dir / CONTINUED).unlink(missing_ok=True)
    distributed.barrier()
    return counts


def print_rates(rates: dict, backend: str, who: str) -> None:
    """This rank's feature and disk rates, and which of them held the other back."""
    source = "the servers" if backend == "vllm" else "the target"
    console.print(
        f"extract{who}: {source} {rates['compute_tokens_per_s']:.0f} "
        f"tok/s, disk {rates['disk_mb_per_s']:.0f} MB/s; bottleneck: "
        + (
            f"the disk ({source} waited on it {rates['compute_waited_on_disk']:.0%} of the time)"
            if rates["bottleneck"] == "disk"
            else f"{source} (the writer was idle {rates['disk_idle']:.0%} of the time)"
        )
    )


def write_index(
    ctx: StageContext, shards: list[int], hidden: int, aux_ids: list[int], rate: float, rates: dict | None
) -> dict:
    """Rank 0, once every rank is done: the index over the shards numbered ``shards`` (refused while one is missing
    or damaged), and the stage's counts (``rates``: this rank's, when it extracted)."""
    cfg, dtype, backend = ctx.cfg, ctx.cfg.extract.dtype, ctx.cfg.extract.backend
    found = [sh.complete_shard(ctx.dir / sh.shard_name(n)) for n in shards]
    missing = [sh.shard_name(n) for n, e in enumerate(found) if e is None]
    entries = [e for e in found if e is not None]
    if missing:
        raise EaglekitError(
            f"extract: {len(missing)} shards are missing or damaged after the run, e.g. {missing[0]}",
            "rerun the same command: it re-extracts only those",
        )
    sh.write_index(
        ctx.dir,
        entries,
        {
            "hidden_size": hidden,
            "aux_layer_ids": aux_ids,
            "dtype": dtype,
            "backend": backend,
            "target": cfg.target.model,
            "bytes_per_token": sh.bytes_per_token(hidden, dtype),
        },
    )
    index = json.loads((ctx.dir / sh.INDEX).read_text())
    counts = {
        "shards": len(entries),
        "samples": index["samples"],
        "tokens": index["tokens"],
        "bytes": index["bytes"],
        "dtype": dtype,
        "backend": backend,
        "tokens_per_s": round(rate, 1),
    }
    if rates is not None:
        counts |= {k: rates[k] for k in ("compute_tokens_per_s", "disk_mb_per_s", "bottleneck")}
    console.print(
        f"extract: {counts['shards']} shards, {counts['tokens']} tokens, {human_bytes(counts['bytes'])} "
        f"({dtype}, {index['bytes'] / max(index['tokens'], 1):.0f} bytes per token)"
    )
    return counts


def capture_self_check(target: TargetFeatures, store, lengths, pending: list[int]) -> None:
    """The capture self-check's in-process twin (``eaglekit.preflight.capture``) on the shortest pending sample: the
    aux taps against the model's hidden_states, the final rows against its own log-probs; a mismatch stops here."""
    from eaglekit.preflight.capture import check_in_process  # lazy: heavy (torch)

    shortest = min(pending, key=lambda i: lengths[i])
    check = check_in_process("capture self-check", target, store[shortest][1], target.aux_layer_ids)
    if check.status == "fail":
        raise EaglekitError(f"extract: capture self-check: {check.detail}", check.remedy)
    console.print(f"extract: capture self-check: {check.detail}")


def _extract_hf(cfg, target: TargetFeatures, store, lengths, plan, todo, sink, meter) -> None:
    """The target in this process: length-sorted batches of each shard; rows are encoded on the device."""
    import torch  # lazy: heavy (torch)

    from eaglekit.data import shards as shard_tensors  # lazy: heavy (torch)
    from eaglekit.training.data import pad  # lazy: heavy (torch)

    for n in todo:
        slot = {i: j for j, i in enumerate(plan[n])}
        for batch in sh.plan_batches(plan[n], lengths, cfg.extract.batch_tokens):
            ids = [store[i][1] for i in batch]
            feats = target(pad(ids), pad([torch.ones_like(t) for t in ids]), with_logits=False)
            rows = shard_tensors.encode(feats.aux, feats.last_hidden, cfg.extract.dtype).to("cpu")
            sink.put(
                n,
                [
                    (
                        slot[i],
                        shard_tensors.Rows(
                            rows.aux[b, : lengths[i]],
                            rows.last_hidden[b, : lengths[i]],
                            None if rows.scale_exp is None else rows.scale_exp[b, : lengths[i]],
                        ),
                    )
                    for b, i in enumerate(batch)
                ],
            )
            meter.update(sum(lengths[i] for i in batch), shard=f"{n + 1}/{len(plan)}")


def _extract_vllm(ctx: StageContext, norm, store, plan, todo, sink, meter, aux_ids, n_layers, hidden) -> None:
    """vLLM servers: every sample of the pending shards in flight (bounded), rows written as they arrive."""
    from eaglekit.data import shards as shard_tensors  # lazy: heavy (torch)
    from eaglekit.serving.vllm_features import FeatureClient, feature_api_key, server_layer_ids  # lazy: heavy (torch)
    from eaglekit.training import distributed  # lazy: heavy (torch)

    cfg, source = ctx.cfg, ctx.resolved.feature_source
    v = source.servers
    layer_ids = server_layer_ids(aux_ids, n_layers)
    prefix = f"ek{ctx.fingerprint[:10]}-r{distributed.rank()}"
    in_flight = 2 * v.concurrency * len(v.servers)

    async def extract_all() -> None:
        async with FeatureClient(
            v, feature_api_key(source), source.served_model, layer_ids, hidden, norm, prefix
        ) as client:
            left = client.remove_leftovers()
            if left:
                console.print(f"extract: removed {left} files of an earlier, interrupted run from {v.storage_path}")
            slots = asyncio.Semaphore(in_flight)
            failures: list[BaseException] = []
            tasks: set[asyncio.Task] = set()

            async def one(n: int, j: int, i: int) -> None:
                try:
                    ids = store[i][1]
                    await client.capture(
                        i,
                        ids.tolist(),
                        lambda cap: sink.put(
                            n, [(j, shard_tensors.encode(cap.aux, cap.last_hidden, cfg.extract.dtype))]
                        ),
                    )
                    meter.update(len(ids), shard=f"{n + 1}/{len(plan)}")
                except RequestFailed as err:
                    failures.append(sample_failed(store.ids[i], err))
                except Exception as err:  # the first failure stops the run (a cancellation just ends the task)
                    failures.append(err)
                finally:
                    slots.release()

            try:
                for n in todo:
                    for j, i in enumerate(plan[n]):
                        await slots.acquire()
                        if failures:
                            break
                        task = asyncio.create_task(one(n, j, i))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    if failures:
                        break
                while tasks and not failures:
                    await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                client.remove_leftovers()
            if failures:
                raise failures[0]

    asyncio.run(extract_all())


def sample_failed(sample_id: str, err) -> EaglekitError:
    """A sample the servers failed ``err.attempts`` times: the run stops, what it committed is kept."""
    return EaglekitError(
        f"extract: sample {sample_id!r} failed after {err.attempts} attempts: {err.reason}",
        "check the servers (`eaglekit preflight CONFIG --stage extract`), then rerun the same command: "
        "committed shards are kept",
    )


# ---------------------------------------------------------------------------------------- vLLM helpers


def vllm_serve_command(cfg: RunConfig) -> str:
    """The command that starts one feature server for this config (the same for every server)."""
    from eaglekit.serving.feature_transports import feature_serve_command  # lazy: heavy (torch)
    from eaglekit.serving.vllm_features import server_layer_ids  # lazy: heavy (torch)

    if cfg.extract.vllm is None:
        raise EaglekitError(
            "extract.vllm is not set",
            "add extract: {mode: offline, backend: vllm, vllm: {servers: [...], storage_path: ...}} to the config",
        )
    resolved = ResolvedRun(cfg)
    hf, aux = resolved.target_and_aux
    ids = server_layer_ids(aux, hf.num_hidden_layers)
    tokens = os.path.join(cfg.run_dir, "prepare", "tokens.safetensors")
    longest = int(TokenStore(tokens).lengths.max()) + 1 if os.path.exists(tokens) else None
    return feature_serve_command(resolved.feature_source, ids, longest)


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """The shards. Pre-flight sizes the plan of the prepared tokens exactly (estimate_bytes, estimate_files) and
    the write rate a pilot measured; a plan projects the same bytes per token from the figures."""
    if sizes is None:
        return Estimate(bytes=estimate_bytes(ctx), files=estimate_files(ctx), write_rate=estimate_write_rate(ctx))
    est = Estimate()
    n, t, hidden, dtype = sizes.samples, sizes.mean_tokens, sizes.hidden_size, sizes.dtype
    if n is None or t is None or not hidden:
        return est
    tokens = n * t
    per_token = sh.bytes_per_token(int(hidden), dtype)
    est.per_sample_bytes = t * per_token
    est.bytes = n * est.per_sample_bytes + math.ceil(tokens / ctx.cfg.extract.shard_tokens) * (1 << 16)
    what = (
        "4 × H + 4 one-byte power-of-two scales"
        if dtype == "fp8"
        else f"(3 × H aux + H final) × {per_token // (4 * int(hidden))} B"
    )
    est.how.append(f"{n:,.0f} samples × {t:,.0f} tok × {per_token:,} B/tok [{dtype}: {what}, H = {int(hidden):,}]")
    rate = sizes.extract_tok_per_s
    if rate:
        est.seconds = tokens / rate
        est.need_write_rate = rate * per_token
        est.how.append(f"time: {tokens:,.0f} tok ÷ {rate:,.0f} tok/s; writes {human_bytes(est.need_write_rate)}/s")
        disk = sizes.write_bytes_per_s
        if disk and est.need_write_rate > disk:
            est.seconds = est.bytes / disk
            est.how.append(f"disk-bound: the disk takes {human_bytes(disk)}/s, so {human_bytes(est.bytes)} ÷ that")
    return est


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="prepare/tokens.safetensors and the target (offline mode only)",
    writes="extract/shard-*.safetensors, extract/index.json",
    params=params,
    checks=checks,
    run=run,
    runs_for=lambda cfg: cfg.extract.offline,
    estimate=estimate,
    kept=kept,
    damaged=damaged,
    continues=continues,
    live_counts=live_counts,
)

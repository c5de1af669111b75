"""train: fit the EAGLE-3 drafter with training-time test on the target's features.

Reads ``prepare/tokens.safetensors``, ``vocab/vocab.safetensors`` and, in offline mode, ``extract/`` (in stream
mode the vLLM feature servers instead: ``eaglekit.training.stream``);
writes ``train/checkpoints/{step-N,best,latest}``, ``train/metrics.jsonl``, ``train/summary.json`` and
``train/curves.png``. The loop itself is ``eaglekit.training.loop``; this module is the stage's contract:
what the outputs depend on, the checks before a long run, and the disk it needs.

Under torchrun every rank runs ``run``; only rank 0 holds the run lock and writes (see
``eaglekit.training.distributed``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from eaglekit.config import RunConfig
from eaglekit.config.train import LEGACY_ADAM_BETAS
from eaglekit.contract import Estimate, Sizes, Stage, StageContext
from eaglekit.data.shard_files import bytes_per_token
from eaglekit.data.tokens import sample_lengths
from eaglekit.data.vocab import vocab_origin
from eaglekit.errors import EaglekitError
from eaglekit.hub import cached_drafter, download_drafter, is_hub_id, local_folder
from eaglekit.preflight import CheckResult, disk, fail, files, gpus, ok, run_directory, skip, warn
from eaglekit.preflight.gpus import target_placement
from eaglekit.progress import console, format_duration, human_bytes
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import OTHER_DONE, file_identity
from eaglekit.training.checkpoint_integrity import resume_words

if TYPE_CHECKING:
    from eaglekit.training.memory import StepMemory

NAME = "train"
UPSTREAM = "extract"  # in online mode the pipeline steps over the skipped extract, to vocab


MIN_SAMPLES = 100  # fewer training samples than this make a drafter that cannot generalise


def params(run: ResolvedRun) -> dict:
    """What the drafter depends on: the values training computes with, as resolved, under this stage's own names (a
    key renamed or moved in the config leaves them as they were). The window as auto chose it: a serving context or
    training length that moves it makes the drafter stale, auto resolving to what an explicit value said does not.
    The family's shape keys as set (unset: the target's, whose identity is here). Not here: when checkpoints are
    written, and how many ranks split each row (the step is the same either way, tests/drafters/test_context_parallel.py)."""
    cfg = run.cfg
    t, ttt = cfg.train, cfg.train.ttt
    p = {
        "draft": {
            **t.draft.model_dump(exclude_none=True, exclude={"architecture", "sliding_window"}),
            "architecture": run.family,
            "sliding_window": run.window.window,
        },
        "ttt": {
            "steps": ttt.steps,
            "decay": ttt.decay,
            "step_weights": ttt.step_weights,
            "loss": ttt.loss.model_dump(),
            "loss_normalization": ttt.loss_normalization,
            "noise": ttt.noise,
            "noise_scale": ttt.noise_scale,
            "anchor_weight": ttt.anchor_weight,
            "activation_checkpointing": ttt.activation_checkpointing,
            "attention": ttt.attention,
            "head_loss": ttt.head_loss,
            "compile": ttt.compile,
        },
        "remap_vocab": t.remap_vocab,
        "optimizer": t.optimizer,
        "muon_weight_decay": t.muon_weight_decay,
        "lr": t.lr,
        "min_lr_ratio": t.min_lr_ratio,
        "warmup_steps": t.warmup_steps,
        **({} if t.adam_betas == LEGACY_ADAM_BETAS else {"adam_betas": t.adam_betas}),
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "max_steps": t.max_steps,
        "epochs": t.epochs,
        "early_stop_patience": t.early_stop_patience,
        "eval_every": t.eval_every,
        "eval_samples": t.eval_samples,
        "log_every": t.log_every,
        "save_every": t.save_every,
        "keep_last": t.keep_last,
        "packing": t.packing,
        "pack_length": t.pack_length,
        "seed": t.seed,
        "dtype": t.dtype,
        "distributed": t.distributed,
        "init_lm_head_from_target": t.init_lm_head_from_target,
        "freeze_lm_head": t.freeze_lm_head,
        **files.read_identities(cfg, "target", "tokens", "vocab"),
        "eval_fraction": cfg.data.eval_fraction,
        "features": cfg.extract.mode,
    }
    if cfg.extract.streamed:  # the rows are encoded as extract would store them (fp8 rounds them)
        p["feature_dtype"] = cfg.extract.dtype
    if not cfg.extract.offline:  # the data order's blocks (offline: the shards, in extract's fingerprint)
        p["data_blocks"] = cfg.extract.shard_tokens
    if t.init_from:
        local = Path(t.init_from).exists() or not is_hub_id(t.init_from)
        p["init_from"] = file_identity(t.init_from) if local else {"hub": t.init_from}
    return p


def packing(ctx: StageContext):
    from eaglekit.training.data import pack_length  # lazy: heavy (torch)

    tc = ctx.cfg.train
    if not tc.packing:
        return ok("packing", "off: length-bucketed, right-padded batches (train.packing: true packs samples into rows)")
    features = (
        f"{ctx.cfg.extract.mode} features: each document extracted alone"
        if not ctx.cfg.extract.online
        else "online features: the target keeps documents apart by position_ids (checked on the first packed batch)"
    )
    return ok(
        "packing",
        f"on: {tc.batch_size} rows of up to {pack_length(ctx.cfg)} tokens per micro-batch, attention "
        f"and positions per document; {features}",
    )


def anchor(ctx: StageContext):
    tc = ctx.cfg.train
    weight = tc.ttt.anchor_weight
    if not weight:
        return skip("anchor", "train.ttt.anchor_weight is 0: no pull toward the starting weights")
    if not tc.init_from:
        return warn(
            "anchor",
            f"train.ttt.anchor_weight {weight} without train.init_from pulls toward the random initialisation",
            "set train.init_from to the drafter to finetune, or anchor_weight: 0",
        )
    return ok("anchor", f"L2-SP pull toward {tc.init_from}: anchor_weight {weight}")


def draft_vocab_origin(ctx: StageContext):
    """The vocabulary in vocab/ was built from this run's prepared tokens (not copied in from another run)."""
    if {"prepare", "vocab"} & set(ctx.pending):
        return skip("draft vocabulary", "vocab will be rebuilt from this run's tokens before train")
    return CheckResult("draft vocabulary", *vocab_origin(ctx.run.path, ctx.cfg.vocab.model_dump()))


def init_from_download(ctx: StageContext):
    """A hub id in train.init_from is fetched now, before the stage starts, so nothing else runs while it downloads
    (resumed where an earlier attempt stopped: ``hub.py``)."""
    name, path = "init_from download", ctx.cfg.train.init_from
    if not path or not is_hub_id(path):
        return skip(name, "train.init_from is a local folder" if path else "training a new drafter")
    try:
        cached = cached_drafter(path)
        if cached is not None:
            return ok(name, f"{path} is in the Hugging Face cache ({cached})")
        folder = download_drafter(path)
    except EaglekitError as err:
        return fail(name, err.message, err.remedy or "check train.init_from")
    return ok(name, f"{path} downloaded into {folder}")


def init_from_compatible(ctx: StageContext):
    """A drafter to finetune must fit the target (its family says how: hidden sizes, vocab, aux layers, heads,
    positions, tokenizer)."""
    from eaglekit.drafters.registry import family_named, family_of_folder  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import as_check  # lazy: heavy (torch)

    path = ctx.cfg.train.init_from
    if not path:
        return skip("init_from", "training a new drafter")
    folder = local_folder(path)
    if folder is None:
        return skip("init_from", f"{path} is not downloaded (the init_from download check says why)")
    if not folder.exists():
        return fail(
            "init_from",
            f"train.init_from {path} does not exist",
            "point it at a drafter folder (legacy or speculators form), or a hub id org/name",
        )
    family = family_of_folder(folder) or family_named(None)  # none of theirs: the default's loader says why
    return as_check("init_from", family.diagnosis.finetune_check(ctx.cfg, folder, path))


def drafter_shape(ctx: StageContext):
    """The drafter this run trains, derived from the target and train.draft by its family: refused now rather
    than at step 0 (and a better family suggested where there is one)."""
    from eaglekit.drafters.registry import family_named  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import as_check  # lazy: heavy (torch)

    cfg = ctx.cfg
    explicit = {k: v for k, v in cfg.train.draft.model_dump(exclude_defaults=True).items() if v is not None}
    if cfg.train.init_from:
        if explicit:
            return warn(
                "drafter",
                f"train.init_from is set: the drafter keeps its own shape and flags, train.draft "
                f"{explicit} is not used",
                "remove train.draft, or train a new drafter",
            )
        return skip("drafter", "finetuning train.init_from (its own shape)")
    return as_check("drafter", family_named(cfg.train.draft.architecture).diagnosis.shape_check(cfg))


def grown_data(ctx: StageContext) -> CheckResult:
    """The drafter in train's folder was trained with today's settings on other prepared data (prompts added,
    removed or edited since): retraining replaces it, so it is only with --force, and the remedy names both ways —
    retrain on all the samples, or keep the drafter and finetune it on the grown data."""
    name = "trained drafter"
    if ctx.run.folder_state(NAME, ctx.fingerprint) != OTHER_DONE or not files.changed_only(ctx, ("tokens", "vocab")):
        return skip(name, "no drafter trained on other data in the folder")
    try:
        samples = f"the {len(sample_lengths(ctx.run.stage_dir('prepare') / 'tokens.safetensors')):,} prepared samples"
    except EaglekitError:
        samples = "the prepared samples"
    if ctx.force:
        return ok(name, f"retraining on {samples}: --force replaces the drafter trained on the earlier data")
    exported = sorted(p.parent for p in ctx.run.stage_dir("export").glob("*/config.json"))
    published = f"set train.init_from: {exported[0]}" if exported else "export it, then set train.init_from to its form"
    return fail(
        name,
        f"the drafter in {ctx.dir} was trained with these settings on the prepared data before it changed",
        f"retrain on {samples}: `eaglekit run CONFIG --from train --force` (replaces the drafter, its evaluation and "
        f"export; the stages before train stay done), or keep it and finetune it on the grown data: {published} "
        "in a config with another run_dir",
    )


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight import environment, feature_servers, shared_gpus, trackers  # lazy: heavy (torch)
    from eaglekit.preflight.context import serving_context  # lazy: heavy (torch)

    if cfg.extract.streamed:  # the servers compute the features: check them, and the spool's room
        source = [feature_servers.feature_servers, feature_servers.feature_storage, feature_servers.spool_room,
                  feature_servers.feature_smoke]  # fmt: skip
        if shared_gpus.shares_trainer_gpus(cfg):
            source.append(shared_gpu_memory)
    elif cfg.extract.offline:
        source = [files.feature_shards, files.feature_shard_contents]
    else:
        source = [target_placement]
    return [
        run_directory.target_folder,
        files.target_weights,
        environment.software,
        environment.devices,
        gpus.gpus,
        *source,
        packing,
        drafter_shape,
        draft_vocab_origin,
        grown_data,
        init_from_download,
        files.init_from_files,
        init_from_compatible,
        anchor,
        serving_context,
        step_memory_check,
        trackers.trackers,
        disk.write_rate,
    ]


def row_tokens(cfg: RunConfig) -> int:
    """The most tokens one micro-batch can hold on one GPU: rows of prepare.max_length (or train.pack_length); under
    torchrun an epoch's short last batch joins the one before it, so a rank may get one row more."""
    from eaglekit.training.data import pack_length  # lazy: heavy (torch)

    groups = int(os.environ.get("WORLD_SIZE", "1")) // cfg.train.context_parallel  # ranks reading different rows
    extra = 1 if groups > 1 else 0
    return (cfg.train.batch_size + extra) * pack_length(cfg)


def step_memory_both(cfg: RunConfig, context_parallel: int | None = None) -> tuple[StepMemory, StepMemory] | None:
    """One training step's memory on a GPU (bf16 autocast) at the longest micro-batch, without and with
    train.ttt.activation_checkpointing, on one of the ``context_parallel`` ranks splitting each row (default: the
    config's train.context_parallel); None for a family that does not model it or a finetune (its own shape)."""
    from eaglekit.drafters.registry import family_named  # lazy: heavy (torch)

    if cfg.train.init_from:
        return None
    ranks = cfg.train.context_parallel if context_parallel is None else context_parallel
    return family_named(cfg.train.draft.architecture).sizing.step_memory(cfg, row_tokens(cfg), ranks)


def memory_line(m: StepMemory, tokens: int) -> str:
    ranks = m.context_parallel
    own = -(-tokens // ranks)
    split = f" a rank of {ranks} splitting each row" if ranks > 1 else ""
    gathered = f", the row's gathered keys and values {human_bytes(m.gathered)}" if ranks > 1 else ""
    return (
        f"{human_bytes(m.total)}{split} (weights and AdamW {human_bytes(m.weights)}, the row's features and target "
        f"{human_bytes(m.batch)}, kept activations {human_bytes(m.activations)} = {m.per_token / 1e3:,.1f} kB/token "
        f"x {own:,}{gathered}, transient {human_bytes(m.transient)})"
    )


def step_memory_check(ctx: StageContext):
    """The step's GPU memory at the longest micro-batch against the GPUs': refused before the run, with remedies."""
    from eaglekit.training.memory import ranks_to_fit  # lazy: heavy (torch)

    cfg = ctx.cfg
    found = gpus.inventory()
    if isinstance(found, str) or not found:
        return skip("step memory", "no GPU: the step's memory is not checked (`eaglekit plan` gives it)")
    both = step_memory_both(cfg)
    if both is None:
        return skip("step memory", "not modelled for a finetune (train.init_from: its own shape)")
    plain, recomputed = both
    chosen = recomputed if cfg.train.ttt.activation_checkpointing else plain
    smallest = min(gpus.visible(found) or found, key=lambda g: g.total)
    on_gpu = gpus.need_per_gpu(ctx, [smallest]) if cfg.extract.online and not cfg.target.device_map else None
    target = on_gpu[0] if on_gpu else 0  # online: the target shares the GPU
    tokens = row_tokens(cfg)
    detail = f"{tokens:,} tokens a micro-batch: {memory_line(chosen, tokens)}" + (
        f" + the target's {human_bytes(target)}" if target else ""
    )
    if chosen.total + target <= smallest.total:
        return ok("step memory", f"{detail}; GPU {smallest.index} has {human_bytes(smallest.total)}")
    remedies = []
    if not cfg.train.ttt.activation_checkpointing and recomputed.total + target <= smallest.total:
        remedies.append(f"train.ttt.activation_checkpointing: true ({human_bytes(recomputed.total)} a step)")
    ranks = ranks_to_fit(
        lambda m: m.total <= smallest.total,
        lambda n: step_memory_both(cfg, n)[1],  # type: ignore[index]  # modelled above: not None
        most=64,
    )
    if ranks is not None and ranks > cfg.train.context_parallel:
        per_rank = step_memory_both(cfg, ranks)[1]  # type: ignore[index]
        checkpointed = " with train.ttt.activation_checkpointing: true" if recomputed is not plain else ""
        remedies.append(
            f"train.context_parallel: {ranks}{checkpointed} ({ranks} GPUs share each "
            f"row, {human_bytes(per_rank.total)} a rank; under torchrun, with offline features)"
        )
    remedies.append(
        "shorter rows (prepare.max_length / train.pack_length) or train.batch_size: 1, with a sliding window "
        "(train.draft.sliding_window: auto chooses one when you serve far beyond the rows) so that the drafter keeps "
        "its acceptance past the rows it trained on"
    )
    if target:
        remedies.append("offline features (extract.mode: offline), so the target is not on the GPU while training")
    return fail(
        "step memory",
        f"{detail} does not fit GPU {smallest.index}'s {human_bytes(smallest.total)}",
        "; or ".join(remedies),
    )


def shared_gpu_memory(ctx: StageContext):
    """extract.vllm.shares_trainer_gpus: each GPU holds the servers' share and the drafter's step (as step memory)."""
    from eaglekit.preflight import shared_gpus  # lazy: heavy (torch)

    return shared_gpus.check(ctx.cfg, step_memory_both(ctx.cfg), gpus.inventory())


def checkpoint_bytes(cfg: RunConfig) -> tuple[int, int, int]:
    """(all the checkpoints, one checkpoint, the drafter's parameters): each checkpoint holds the drafter (fp32)
    and training_state (weights + two Adam moments, fp32); best/ and the metrics and plots come on top."""
    from eaglekit.drafters.registry import parameter_counts  # lazy: heavy (torch)

    total, trainable = parameter_counts(cfg)
    per_checkpoint = 4 * (total + 3 * trainable)
    return per_checkpoint * (cfg.train.keep_last + 1) + 4 * total + (16 << 20), per_checkpoint, total


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """The checkpoints; in a plan also the time at the training rate."""
    from eaglekit.preflight import shared_gpus  # lazy: heavy (torch)

    cfg = ctx.cfg
    if sizes is None:
        return Estimate(bytes=checkpoint_bytes(cfg)[0])
    est = Estimate()
    if not (Path(cfg.target.model) / "config.json").is_file():
        est.how.append("checkpoints: unknown without the target's config.json")
    else:
        try:
            est.bytes, per, _ = checkpoint_bytes(cfg)
            est.how.append(
                f"{cfg.train.keep_last + 1} checkpoints × {human_bytes(per)} (fp32 weights + 2 Adam moments) + best/"
            )
        except Exception as err:  # noqa: BLE001 - a config eaglekit cannot derive a drafter from: pre-flight says why
            est.how.append(f"checkpoints: unknown ({err})")
    if not cfg.train.init_from:
        choice = ctx.resolved.window
        est.how.append(f"sliding window: {choice.shown} — {choice.why}")
    try:
        both = step_memory_both(cfg)
    except Exception as err:  # noqa: BLE001 - as above: pre-flight names the drafter's problem
        both, est.how = None, [*est.how, f"GPU memory of a step: unknown ({err})"]
    if both is not None:
        n = row_tokens(cfg)
        est.how.append(f"GPU memory of a step at {n:,} tokens (bf16): {memory_line(both[0], n)}")
        checkpointable = both[1] is not both[0]  # a block objective has no checkpointing: one step, twice
        if checkpointable:
            est.how.append(f"  with train.ttt.activation_checkpointing: {human_bytes(both[1].total)}")
        if shared_gpus.shares_trainer_gpus(cfg):
            step = both[1 if cfg.train.ttt.activation_checkpointing else 0].total
            est.how += shared_gpus.plan_lines(cfg, step, gpus.inventory())
        if cfg.train.context_parallel == 1 and n >= 16384:  # what splitting long rows over GPUs would give
            split = [(n, step_memory_both(cfg, n)) for n in (2, 4, 8)]
            checkpointed = " checkpointed," if checkpointable else ""
            est.how.append(
                f"  with train.context_parallel (each row split over N GPUs),{checkpointed} a rank: "
                + ", ".join(f"N={n} {human_bytes(m[1].total)}" for n, m in split if m)
            )
    tokens, rate = sizes.tokens, sizes.train_tok_per_s
    if tokens is not None and rate:
        est.seconds = tokens * (1 - cfg.data.eval_fraction) * cfg.train.epochs / rate
        est.how.append(
            f"time: {tokens:,.0f} tok × {1 - cfg.data.eval_fraction:g} (train split) × {cfg.train.epochs:g} "
            f"epochs ÷ {rate:,.0f} tok/s" + (" (max_steps may stop it earlier)" if cfg.train.max_steps else "")
        )
    if cfg.extract.streamed:
        stream_estimate(ctx.resolved, sizes, est)
    return est


def stream_estimate(run: ResolvedRun, sizes: Sizes, est: Estimate) -> None:
    """extract.mode stream: the disk is the spool (not the dataset), the time the slower of the trainer and the
    servers' feature rate (every epoch asks again unless extract.stream.cache_gb holds the whole train split)."""
    cfg = run.cfg
    if not cfg.extract.through_mooncake:
        spool = run.spool_bytes
        if est.bytes is not None:
            est.bytes += spool
        est.how.append(
            f"spool: {human_bytes(spool)} (extract.stream.spool_gb: the servers' request files in "
            "extract.vllm.storage_path, counted as if on this volume); no feature shards"
        )
    else:
        est.how.append("no spool: the hidden states go through the Mooncake store, not files; no feature shards")
    tokens, served = sizes.tokens, sizes.extract_tok_per_s
    if tokens is None or not served:
        est.how.append("servers' feature rate: unknown (a pilot extract or stream measures it; --extract-tok-per-s)")
        return
    trained = tokens * (1 - cfg.data.eval_fraction)
    cached = bool(sizes.hidden_size) and run.cache_bytes >= trained * bytes_per_token(int(sizes.hidden_size or 0),
                                                                                         sizes.dtype)  # fmt: skip
    asked = trained * (1 if cached else cfg.train.epochs) + tokens * cfg.data.eval_fraction
    server_seconds = asked / served
    trainer_seconds = est.seconds
    est.how.append(
        f"servers: {asked:,.0f} tok asked ({'once, then from the cache' if cached else 'again every epoch'}) ÷ "
        f"{served:,.0f} tok/s = {format_duration(server_seconds)}"
    )
    if trainer_seconds is None:
        est.seconds = server_seconds
        est.how.append("time: the servers' (the trainer's rate is unknown)")
        return
    est.seconds = max(trainer_seconds, server_seconds)
    bound = "server-bound" if server_seconds > trainer_seconds else "trainer-bound"
    est.how.append(
        f"time: the slower of the trainer ({format_duration(trainer_seconds)}) and the servers "
        f"({format_duration(server_seconds)}): {bound}"
    )


def kept(ctx: StageContext) -> str:
    """What an interrupted or failed run leaves to resume from."""
    from eaglekit.training.step_checkpoints import Checkpoints  # lazy: heavy (torch)

    try:
        latest = Checkpoints(ctx.dir / "checkpoints", ctx.cfg.train.keep_last).latest()
    except EaglekitError:
        latest = None
    return resume_words(ctx.dir / "checkpoints", latest)  # a damaged latest is not where a rerun resumes


def live_counts(stage_dir: Path) -> dict:
    """What `status` shows while training runs or after it was stopped: the last logged step and checkpoint."""
    counts: dict = {}
    pointer = Path(stage_dir) / "checkpoints" / "latest"
    if pointer.exists():
        counts["checkpoint"] = pointer.read_text().strip()
    metrics = Path(stage_dir) / "metrics.jsonl"
    if metrics.exists():
        lines = [line for line in metrics.read_text().splitlines() if line.strip()]
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line torn by a kill
            counts["steps"] = row["step"]
            break
    return counts


def run(ctx: StageContext) -> dict:
    from eaglekit.drafters.registry import family_of_run  # lazy: heavy (torch)
    from eaglekit.preflight import feature_servers  # lazy: heavy (torch)
    from eaglekit.training.loop import train  # lazy: heavy (torch)

    if not ctx.cfg.train.init_from:  # what auto chose, in the log and the ledger
        choice = ctx.resolved.window
        console.print(f"train: sliding window {choice.shown} ({choice.why})")
        ctx.ledger_extra["sliding_window"] = {"window": choice.window, "why": choice.why}
    check = feature_servers.stream_capture_check(ctx.cfg) if ctx.cfg.extract.streamed else None
    counts = train(ctx.cfg, family_of_run(ctx.cfg).training, ctx.run, ctx.dir, ctx.resuming, capture_check=check)
    tc = ctx.cfg.train
    if counts["steps"] < tc.warmup_steps:
        ctx.warn(
            f"trained {counts['steps']} steps, fewer than train.warmup_steps ({tc.warmup_steps}): the learning "
            "rate never reached train.lr; lower warmup_steps or train longer"
        )
    if counts.get("train_samples", MIN_SAMPLES) < MIN_SAMPLES:
        ctx.warn(
            f"trained on {counts['train_samples']} samples (fewer than {MIN_SAMPLES}): the drafter learns those "
            "by heart and will not generalise; generate more (data.max_samples)"
        )
    return counts


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="prepare/, vocab/, and extract/ (offline), the live target (online) or the vLLM feature servers (stream)",
    writes="train/checkpoints/, train/metrics.jsonl, train/summary.json, train/curves.png",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
    kept=kept,
    live_counts=live_counts,
)

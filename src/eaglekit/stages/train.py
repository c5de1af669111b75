"""train: fit the EAGLE-3 drafter with training-time test on the target's features.

Reads ``prepare/tokens.safetensors``, ``vocab/vocab.safetensors`` and, in offline mode, ``extract/``;
writes ``train/checkpoints/{step-N,best,latest}``, ``train/metrics.jsonl``, ``train/summary.json`` and
``train/curves.png``. The loop itself is ``eaglekit.training.loop``; this module is the stage's contract:
what the outputs depend on, the checks before a long run, and the disk it needs.

Under torchrun every rank runs ``run``; only rank 0 holds the run lock and writes (see
``eaglekit.training.distributed``).
"""

from __future__ import annotations

from pathlib import Path

from eaglekit.config import RunConfig
from eaglekit.errors import EaglekitError
from eaglekit.model.drafter import DrafterConfig
from eaglekit.model.target import aux_layer_ids, target_hf_config, target_identity
from eaglekit.preflight import checks as common
from eaglekit.preflight import disk, environment, files, gpus
from eaglekit.preflight import fail, ok, skip, warn
from eaglekit.rundir import file_identity

NAME = "train"
UPSTREAM = "extract"  # the pipeline maps it to "vocab" in online mode


MIN_SAMPLES = 100  # fewer training samples than this make a drafter that cannot generalise


def params(cfg: RunConfig) -> dict:
    # when checkpoints are written does not change the drafter: editing it must not make a run stale
    p = cfg.train.model_dump(exclude={"save_every_minutes"})
    p["target"] = target_identity(cfg.target)
    p["eval_fraction"] = cfg.data.eval_fraction
    p["features"] = cfg.extract.mode
    if cfg.train.init_from:
        p["init_from"] = file_identity(cfg.train.init_from)
    return p


def packing(ctx):
    from eaglekit.training.data import pack_length

    tc = ctx.cfg.train
    if not tc.packing:
        return ok("packing", "off: length-bucketed, right-padded batches (train.packing: true packs samples into rows)")
    features = ("offline features: each document extracted alone" if ctx.cfg.extract.mode == "offline" else
                "online features: the target keeps documents apart by position_ids (checked on the first packed batch)")
    return ok("packing", f"on: {tc.batch_size} rows of up to {pack_length(ctx.cfg)} tokens per micro-batch, attention "
                         f"and positions per document; {features}")


def anchor(ctx):
    tc = ctx.cfg.train
    if not tc.anchor_weight:
        return skip("anchor", "train.anchor_weight is 0: no pull toward the starting weights")
    if not tc.init_from:
        return warn("anchor", f"train.anchor_weight {tc.anchor_weight} without train.init_from pulls toward the random "
                              "initialisation", "set train.init_from to the drafter to finetune, or anchor_weight: 0")
    return ok("anchor", f"L2-SP pull toward {tc.init_from}: anchor_weight {tc.anchor_weight}")


def init_from_compatible(ctx):
    """A drafter to finetune must fit the target: hidden sizes, vocab, aux layers, heads, positions, tokenizer."""
    from eaglekit.model import checkpoints

    path = ctx.cfg.train.init_from
    if not path:
        return skip("init_from", "training a new drafter")
    if not Path(path).exists():
        return fail("init_from", f"train.init_from {path} does not exist", "point it at a drafter folder (legacy or speculators form)")
    try:
        drafter, _info = checkpoints.load_drafter(path)
        hf = target_hf_config(ctx.cfg.target)
        aux = aux_layer_ids(ctx.cfg.target, hf.num_hidden_layers)
        problems = checkpoints.check_compatible(drafter.config, hf, aux, tokenizer_vocab_size=_tokenizer_size(ctx.cfg))
    except EaglekitError as err:
        return fail("init_from", f"{path}: {err.message}", err.remedy or "check the drafter folder")
    if problems:
        return fail("init_from", f"{path} does not fit the target {ctx.cfg.target.model}: " + "; ".join(problems),
                    "finetune a drafter made for this target, or train a new one (remove train.init_from)")
    vocab = "remapped onto this run's draft vocab" if ctx.cfg.train.remap_vocab else "its own draft vocab kept"
    return ok("init_from", f"{path} fits the target ({drafter.config.draft_vocab_size} draft tokens, {vocab})")


def _tokenizer_size(cfg: RunConfig) -> int | None:
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(cfg.target.model, trust_remote_code=cfg.target.trust_remote_code))
    except (OSError, ValueError):
        return None


def checks(cfg: RunConfig) -> list:
    from eaglekit.stages.extract import target_placement

    online = [target_placement] if cfg.extract.mode != "offline" else [files.feature_shards]
    return [common.target_folder, files.target_weights, environment.software, environment.devices, gpus.gpus,
            *online, packing, files.init_from_files, init_from_compatible, anchor, disk.write_rate]


def parameter_counts(dc: DrafterConfig) -> tuple[int, int]:
    """(all parameters, trainable ones) of a drafter: everything but the frozen [V, H] embedding trains."""
    h, q, kv = dc.hidden_size, dc.num_attention_heads * dc.head_dim, dc.num_key_value_heads * dc.head_dim
    layer = 2 * h * q + 2 * (2 * h * kv) + q * h + 3 * h * dc.intermediate_size + 3 * h
    trainable = 3 * dc.target_hidden_size * h + layer + h + dc.draft_vocab_size * h
    return trainable + dc.vocab_size * h, trainable


def estimate_bytes(ctx) -> int:
    """Checkpoints: each holds the drafter (fp32) and training_state (weights + two Adam moments, fp32)."""
    cfg = ctx.cfg
    hf = target_hf_config(cfg.target)
    dc = DrafterConfig.from_target_config(hf, cfg.vocab.draft_vocab_size, aux_layer_ids(cfg.target, hf.num_hidden_layers),
                                          **cfg.train.draft.model_dump())
    total, trainable = parameter_counts(dc)
    per_checkpoint = 4 * (total + 3 * trainable)
    return per_checkpoint * (cfg.train.keep_last + 1) + 4 * total + (16 << 20)  # + best/ + metrics and plots


def kept(ctx) -> str:
    """What an interrupted or failed run leaves to resume from."""
    from eaglekit.training.loop import Checkpoints

    try:
        latest = Checkpoints(ctx.dir / "checkpoints", ctx.cfg.train.keep_last).latest()
    except EaglekitError:
        latest = None
    return f"checkpoint {latest} (a rerun resumes from it)" if latest else "no checkpoint yet (a rerun starts over)"


def live_counts(stage_dir) -> dict:
    """What `status` shows while training runs or after it was stopped: the last logged step and checkpoint."""
    import json

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


def run(ctx) -> dict:
    from eaglekit.training.loop import train

    counts = train(ctx)
    tc = ctx.cfg.train
    if counts["steps"] < tc.warmup_steps:
        ctx.warn(f"trained {counts['steps']} steps, fewer than train.warmup_steps ({tc.warmup_steps}): the learning "
                 "rate never reached train.lr; lower warmup_steps or train longer")
    if counts.get("train_samples", MIN_SAMPLES) < MIN_SAMPLES:
        ctx.warn(f"trained on {counts['train_samples']} samples (fewer than {MIN_SAMPLES}): the drafter learns those "
                 "by heart and will not generalise; generate more (data.max_samples)")
    return counts

"""The training loop of the train stage: build the drafter, run its objective on the target's features, evaluate,
checkpoint.

Reads top to bottom: the drafter's family (handed in by the train stage, which asks ``drafters/registry``), which
builds the drafter (fresh from the target's config, or finetuned from ``train.init_from``) and its objective
(EAGLE-3's training-time test, a block drafter's anchored blocks), the feature source (``training/features.py``: the
live target, or offline shards plus the target's lm_head), the optimizer and schedule (``training/optim.py``), the
data order (``training/data.py``), then the loop — micro-batches, an optimizer step, logging
(``training/metrics.py``), held-out evaluation, checkpoints (``training/step_checkpoints.py``).

Exact resume: micro-batch u of the run is a function of (seed, u), and a checkpoint holds parameters, optimizer,
scheduler, step, the open logging window and the RNG states, so a run killed after checkpoint S and resumed repeats
steps S+1... exactly as the uninterrupted run does. Only rank 0 writes files; every rank computes.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.data.tokens import TokenStore
from eaglekit.data.vocab import load_vocab
from eaglekit.interrupt import StopRequest
from eaglekit.model.target import TargetReads, aux_layer_ids, embedding_and_head, load_target, target_hf_config
from eaglekit.progress import Meter
from eaglekit.rundir import RunDir
from eaglekit.training import distributed as dist
from eaglekit.training.context_parallel import ContextGroup
from eaglekit.training.data import Batch, Loader, RunBatches
from eaglekit.training.distributed import say, wrap
from eaglekit.training.early_stop import TauWatch
from eaglekit.training.features import Features
from eaglekit.training.figures import simulated_acceptance_length
from eaglekit.training.guard import refuse_non_finite_step, refuse_non_finite_weights
from eaglekit.training.metrics import Metrics, Window
from eaglekit.training.objective import Training
from eaglekit.training.optim import build_optimizer, build_scheduler
from eaglekit.training.step_checkpoints import (
    STATE,
    Checkpoints,
    checkpoint_due,
    load_state,
    model_state,
    optim_state,
    rng_state,
    set_rng_state,
    without_frozen_embedding,
)
from eaglekit.training.stream import FeatureStream, open_stream

# Names the tests and benchmarks reach through this module (they patch Metrics.write to kill a run mid-way).
__all__ = ["Features", "Metrics", "train", "wrap"]


@dataclass
class Progress:
    """Where the run stands besides its weights: what a checkpoint restores and the summary reports."""

    step: int = 0
    best_tau: float = -1.0
    tokens: int = 0
    seconds_before: float = 0.0
    window: dict | None = None

    @classmethod
    def restore(cls, state: dict) -> Progress:
        return cls(state["step"], state["best_tau"], state["tokens"], state["seconds"], state["window"])


def train(
    cfg: RunConfig,
    family: Training,
    run: RunDir,
    out_dir: Path,
    resuming: bool,
    capture_check: Callable | None = None,
) -> dict[str, Any]:
    """Train ``family``'s drafter into ``out_dir`` (the train stage's folder); ``resuming``: continue its latest
    checkpoint. Returns the counts the ledger and `eaglekit status` show. ``capture_check``: the capture self-check a
    streamed run makes on its first requests (``training/stream.open_stream``)."""
    dist.init()
    t = set_up(cfg, family, run, out_dir, resuming, capture_check)
    last_eval = t.held_out(0, t.metrics, t.ckpts, t.progress) if t.progress.step == 0 else None
    last_eval, seconds = run_steps(t, last_eval)
    return finish(t, out_dir, last_eval, seconds)


@dataclass
class TrainingRun:
    """Everything one training run holds: its drafter and objective (``model``: the objective wrapped for data
    parallelism), the optimizer and schedule, the data, the feature source, the checkpoints, the log."""

    cfg: RunConfig
    drafter: nn.Module
    model: nn.Module
    named_params: list[tuple[str, nn.Parameter]]
    optim: Any
    sched: Any
    batches: RunBatches
    store: TokenStore
    features: Features
    stream: FeatureStream | None
    inputs_of: StepInputs
    autocast: Callable[[], contextlib.AbstractContextManager]
    positions: int  # figures the objective reports per draft position
    fsdp: bool
    ckpts: Checkpoints
    held_out: HeldOut
    metrics: Metrics
    progress: Progress
    total_steps: int
    n_trainable: int  # parameters the optimizer steps
    notes: dict  # where the drafter's vocabulary and head came from, the step's kernels: for the ledger


def set_up(cfg: RunConfig, family: Training, run: RunDir, out_dir: Path, resuming: bool,
           capture_check: Callable | None) -> TrainingRun:  # fmt: skip
    """The drafter, its objective, the optimizer, the data and the feature source, and the step a resumed run
    continues from (its weights, optimizer, schedule, RNG and log restored)."""
    tc = cfg.train
    device, world = dist.device(), dist.world_size()
    context = dist.context_group(tc.context_parallel)  # the ranks that split each row with this one (or None)
    groups, group = dist.data_parallel(context)
    fsdp = dist.active() and tc.distributed == "fsdp"
    ckpts = Checkpoints(out_dir / "checkpoints", tc.keep_last, family)
    # rank 0 decides whether this resumes (the run directory is its to read); the others follow
    resume_from = dist.broadcast(ckpts.resume_point(resuming) if dist.is_main() else None)
    seed_everything(tc.seed)

    store = TokenStore(run.stage_dir("prepare") / "tokens.safetensors")
    drafter, features, notes = drafter_and_features(cfg, family, run.path, device)
    autocast = autocast_for(tc.dtype, device)
    objective = family.objective(drafter, tc, device, context)
    positions, weights, notes["step_kernels"] = objective.positions, objective.weights, objective.kernels
    inputs_of = StepInputs(features, context, objective.halo, objective.reads)
    model = wrap(objective.module, tc.distributed, device)
    named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optim = build_optimizer(tc, named_params)
    batches = RunBatches(
        cfg, store, features.blocks(store, store.lengths.tolist(), cfg.extract.shard_tokens), features.store,
        groups, group,
    )  # fmt: skip
    total_steps = batches.total_steps(tc)
    stream = open_stream(cfg, run.path, batches, dist.rank(), capture_check) if cfg.extract.streamed else None
    if stream is not None:  # the held-out rows, asked per evaluation batch (kept in memory when they fit)
        batches.feature_store = stream.held_out_rows([batches.share(b) for b in batches.held_out()])
    sched = build_scheduler(tc, optim, total_steps)
    held_out = HeldOut(model, drafter, inputs_of, batches, autocast, fsdp, positions, weights)

    metrics = Metrics(out_dir / "metrics.jsonl")
    progress = Progress()
    if resume_from:
        state = torch.load(Path(resume_from) / STATE, map_location="cpu", weights_only=False)
        load_state(model, drafter, optim, state["model"], state["optimizer"], fsdp)
        sched.load_state_dict(state["scheduler"])
        progress = Progress.restore(state)
        set_rng_state(state["rng"])
        metrics.truncate_after(progress.step)
        say(f"train: resumed from {resume_from} at step {progress.step} of {total_steps}")
    elif dist.is_main():
        metrics.path.unlink(missing_ok=True)
    metrics.open_trackers(cfg, run.path.name, progress.step if resume_from else None)
    n_trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    say(run_line(cfg, batches, n_trainable, total_steps, world))
    return TrainingRun(
        cfg, drafter, model, named_params, optim, sched, batches, store, features, stream, inputs_of, autocast,
        positions, fsdp, ckpts, held_out, metrics, progress, total_steps, n_trainable, notes,
    )  # fmt: skip


def run_steps(t: TrainingRun, last_eval: dict | None) -> tuple[dict | None, float]:
    """The optimizer steps from where the run stands to its end (or to an early stop, or a Ctrl-C), with logging,
    held-out evaluation and checkpoints. Returns the last evaluation and the run's seconds."""
    tc, progress = t.cfg.train, t.progress
    window = Window(t.positions, progress.window)
    watch = TauWatch(tc.early_stop_patience)  # starts afresh on resume: it needs patience evaluations again
    t0, local_tokens = time.monotonic(), 0
    params = [p for _, p in t.named_params]
    t.model.train()
    # Ctrl-C / SIGTERM finish the step in progress and write a checkpoint before stopping (a second one stops at once)
    stop = StopRequest(
        lambda name: say(
            f"[yellow]train: {name}: finishing this step and writing a checkpoint (send it again to stop at once)[/]"
        )
    )
    last_save = time.monotonic()
    meter_name = "train" if dist.is_main() else f"train (rank {dist.rank()})"
    with (
        stop,
        contextlib.closing(t.stream or Loader(t.batches.micro_batch, t.store, t.features.store)) as loader,
        Meter(meter_name, total=t.total_steps, unit="step", initial=progress.step) as meter,
    ):
        for step in range(progress.step, t.total_steps):
            lr = float(t.sched.get_last_lr()[0])
            grad_norm, tokens, loss = optimizer_step(t.model, loader, t.inputs_of, window, step, tc, t.autocast, params)
            refuse_non_finite_step(step + 1, loss, grad_norm, lr, t.ckpts)
            t.optim.step()
            refuse_non_finite_weights(step + 1, t.named_params, lr, t.ckpts)
            t.sched.step()
            t.optim.zero_grad(set_to_none=True)
            done, local_tokens = step + 1, local_tokens + tokens
            progress.step = done

            if done % tc.log_every == 0 or done == t.total_steps:
                window = log_window(t, window, done, lr, grad_norm, time.monotonic() - t0, local_tokens, meter)
            overfit = False
            if done % tc.eval_every == 0 or done == t.total_steps:
                last_eval = t.held_out(done, t.metrics, t.ckpts, progress)
                if last_eval:
                    meter.fields.update(held_out_tau=round(last_eval["tau"], 3))
                    warning, overfit = watch.update(last_eval["tau"], last_eval["loss"])
                    if warning:
                        say(f"[yellow]train: step {done}: {warning}[/]")
            stopping, timed = checkpoint_due(stop, last_save, tc.save_every_minutes)
            if done % tc.save_every == 0 or done == t.total_steps or stopping or timed or overfit:
                progress.window = window.state()
                seconds = progress.seconds_before + time.monotonic() - t0
                save_checkpoint(t.ckpts, t.model, t.drafter, t.optim, t.sched, t.fsdp, progress, t.batches, tc, seconds)
                last_save = time.monotonic()
            meter.update(1)
            if overfit:
                t.total_steps = done  # the run ends here: summary and counts say so
                break
            if stopping:
                say(f"train: stopped after step {done} of {t.total_steps}; checkpoint step-{done} is written")
                t.metrics.close()
                stop.stop()
    t.metrics.close()
    return last_eval, progress.seconds_before + time.monotonic() - t0


def log_window(t: TrainingRun, window: Window, done: int, lr: float, grad_norm: float, elapsed: float,
               local_tokens: int, meter: Meter) -> Window:  # fmt: skip
    """The line of train/metrics.jsonl for the window that ends at step ``done``, and the meter's figures; the next
    window."""
    r = window.reduced()
    t.progress.tokens += r["tokens"]
    t.metrics.write(
        train_row(r, done, t.batches, t.cfg.train, lr, grad_norm, t.progress, t.progress.seconds_before + elapsed)
    )
    meter.fields.update(
        loss=round(r["loss"], 4), acc_0=round(r["acc_k"][0], 4),
        tok_s=round(local_tokens * dist.world_size() / max(elapsed, 1e-9)),
    )  # fmt: skip
    return Window(t.positions)


def finish(t: TrainingRun, out_dir: Path, last_eval: dict | None, seconds: float) -> dict[str, Any]:
    """The final evaluation a resumed run already logged, best/ when nothing was held out, train/summary.json;
    the counts for the ledger."""
    notes = dict(t.notes)
    if t.stream is not None:
        notes["stream"] = t.stream.report()
        say(t.stream.summary())
    total_steps, held_out, metrics, progress = t.total_steps, t.held_out, t.metrics, t.progress
    if last_eval is None and held_out.batches:  # resumed after the final checkpoint: its eval is in the log
        logged = next((r for r in reversed(metrics.rows()) if r["kind"] == "eval" and r["step"] == total_steps), None)
        last_eval = dist.broadcast(logged) or held_out(total_steps, metrics, t.ckpts, progress)
    if not held_out.batches:
        msd = model_state(t.model, t.drafter, t.fsdp)
        if dist.is_main():
            t.ckpts.save_best(total_steps, t.drafter.config, msd, {})
    write_summary(out_dir, metrics, progress, total_steps, seconds, t.n_trainable, last_eval)
    dist.barrier()
    counts = {"steps": total_steps, "train_samples": len(t.batches.train_idx), "tokens": progress.tokens,
              "seconds": round(seconds, 1), **notes}  # fmt: skip
    if last_eval:
        counts |= {"tau": round(last_eval["tau"], 3), "acc_k": [round(a, 3) for a in last_eval["acc_k"]]}
    return counts


# ------------------------------------------------------------------------------------------------ set-up


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def drafter_and_features(
    cfg: RunConfig, family: Training, run_path: Path, device: torch.device
) -> tuple[nn.Module, Features, dict]:
    """The drafter on the device, the source of its training inputs (the live target online, the shards offline)
    and the notes on where its vocabulary and head came from (for the ledger)."""
    d2t, t2d = load_vocab(run_path)
    hf_config = target_hf_config(cfg.target)
    aux_ids = aux_layer_ids(cfg.target, hf_config.num_hidden_layers)
    target_model = load_target(cfg.target, device) if cfg.extract.online else None
    embed, head = embedding_and_head(
        cfg.target.model if target_model is None else target_model, cfg.target.trust_remote_code
    )
    built = family.build(cfg, hf_config, d2t, t2d, embed, head, aux_ids)
    drafter = built.drafter.to(device)
    aux_dtype = torch.bfloat16 if uses_bf16(cfg.train.dtype, device) else torch.float32
    features = Features(
        run_path, built.feature_ids, device, aux_ids, aux_dtype, target_model, head, cfg.extract.streamed
    )
    return drafter, features, built.notes


def uses_bf16(dtype: str, device: torch.device) -> bool:
    """fp32 master weights always; bf16 autocast on GPUs (train.dtype auto) or when asked, fp32 on the CPU."""
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def autocast_for(dtype: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if uses_bf16(dtype, device):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@dataclass
class StepInputs:
    """A batch's step inputs (its features) and the tokens this rank trains on: under context parallelism only its
    share of each row (``training/context_parallel.py``), so a row split across ranks is read, and counted, once."""

    features: Features
    context: ContextGroup | None
    halo: int  # positions past a rank's own whose targets its objective reads
    reads: TargetReads  # what of the target its objective reads (the family's ``Objective.reads``)

    def __call__(self, batch: Batch) -> tuple:
        return self.features(batch if self.context is None else self.context.cut(batch, self.halo), self.reads)

    def tokens(self, batch: Batch) -> int:
        return batch.tokens if self.context is None else self.context.own_tokens(batch)


def run_line(cfg: RunConfig, batches: RunBatches, n_trainable: int, total_steps: int, world: int) -> str:
    tc = cfg.train
    cp = tc.context_parallel
    ranks = f" on {world} processes" + (f" (each row split over {cp} of them)" if cp > 1 else "")
    shape = (
        f"{batches.global_batch} rows of up to {batches.row_tokens} packed tokens"
        if tc.packing
        else str(batches.global_batch)
    )
    return (
        f"train: {n_trainable / 1e6:.2f}M trainable parameters, {len(batches.train_idx)} train / "
        f"{len(batches.held_idx)} held-out samples, {batches.per_epoch} batches of {shape} per epoch, "
        f"{total_steps} steps{ranks if world > 1 else ''} "
        f"({cfg.extract.mode} features)"
    )


# -------------------------------------------------------------------------------------------- one step


def optimizer_step(
    model: nn.Module,
    loader: Loader | FeatureStream,
    inputs_of: StepInputs,
    window: Window,
    step: int,
    tc,
    autocast,
    params: list,
) -> tuple[float, int, float]:
    """Forward and backward over the step's grad_accum micro-batches (DDP syncs on the last one), then the gradient
    clip. Returns (gradient norm before clipping, tokens this rank saw, its summed loss); the caller steps the
    optimizer."""
    tokens, loss_sum = 0, 0.0
    for a in range(tc.grad_accum):
        batch = loader.get(step * tc.grad_accum + a)
        inputs = inputs_of(batch)
        # DDP syncs gradients on the last micro-batch of the step only
        with model.no_sync() if isinstance(model, DDP) and a < tc.grad_accum - 1 else contextlib.nullcontext():
            with autocast():
                loss, out = model(*inputs)
            (loss / tc.grad_accum).backward()
        value = float(loss.detach())
        seen = inputs_of.tokens(batch)
        window.add(out, value, seen)
        tokens, loss_sum = tokens + seen, loss_sum + value
    return float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)), tokens, loss_sum


def train_row(r: dict, done: int, batches: RunBatches, tc, lr: float, grad_norm: float, progress: Progress,
              seconds: float) -> dict:  # fmt: skip
    """One line of train/metrics.jsonl for the window that ends at step ``done``."""
    return {
        "kind": "train",
        "step": done,
        "epoch": round(batches.epoch_progress(done * tc.grad_accum), 4),
        "loss": r["loss"],
        "loss_k": r["loss_k"],
        "acc_k": r["acc_k"],
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": progress.tokens,
        "seconds": round(seconds, 2),
        **({"anchor_distance": math.sqrt(r["anchor"])} if tc.ttt.anchor_weight else {}),
    }


def save_checkpoint(ckpts: Checkpoints, model: nn.Module, drafter: nn.Module, optim, sched, fsdp: bool,
                    progress: Progress, batches: RunBatches, tc, seconds: float) -> None:  # fmt: skip
    """step-N/ with everything an exact resume needs (gathered on every rank under FSDP; rank 0 writes)."""
    msd, osd = model_state(model, drafter, fsdp), optim_state(model, optim, fsdp)
    done = progress.step
    epoch, data_position = batches.position(done * tc.grad_accum)
    if dist.is_main():
        ckpts.save(
            done,
            drafter.config,
            msd,
            {
                "model": without_frozen_embedding(msd, drafter),
                "optimizer": osd,
                "scheduler": sched.state_dict(),
                "step": done,
                "epoch": epoch,
                "data_position": data_position,
                "best_tau": progress.best_tau,
                "window": progress.window,
                "tokens": progress.tokens,
                "seconds": seconds,
                "rng": rng_state(),
            },
        )
    dist.barrier()


# ----------------------------------------------------------------------------------- held-out evaluation


class HeldOut:
    """Held-out evaluation: the objective's figures on the held-out batches, simulated τ from them, and best/ (the
    drafter of the highest τ so far)."""

    def __init__(self, model: nn.Module, drafter: nn.Module, inputs_of: StepInputs,
                 batches: RunBatches, autocast, fsdp: bool, steps: int, step_weights: list[float]):  # fmt: skip
        self.model, self.drafter, self.inputs_of, self.data = model, drafter, inputs_of, batches
        self.autocast, self.fsdp, self.steps, self.step_weights = autocast, fsdp, steps, step_weights
        self.batches = batches.held_out()
        if not self.batches:
            say(
                "[yellow]train: no held-out samples (data.eval_fraction is 0 or too small): "
                "no evaluation; best/ is the final drafter[/]"
            )

    def __call__(self, step: int, metrics: Metrics, ckpts: Checkpoints, progress: Progress) -> dict | None:
        if not self.batches:
            return None
        figures = self.figures()
        metrics.write({"kind": "eval", "step": step, **{k: figures[k] for k in ("loss", "loss_k", "acc_k", "tau")}})
        if figures["tau"] > progress.best_tau:
            progress.best_tau = figures["tau"]
            msd = model_state(self.model, self.drafter, self.fsdp)
            if dist.is_main():
                ckpts.save_best(step, self.drafter.config, msd, {"tau": figures["tau"], "acc_k": figures["acc_k"]})
        return figures

    @torch.no_grad()
    def figures(self) -> dict:
        window = Window(self.steps)
        self.model.eval()
        for entries in self.batches:
            inputs = self.inputs_of(self.data.collate(self.data.share(entries)))
            with self.autocast():
                loss, out = self.model(*inputs)
            window.add(out, float(loss.detach()), 0)
        self.model.train()
        r = window.reduced()
        return {
            "loss": sum(loss * w for w, loss in zip(self.step_weights, r["loss_k"], strict=True)),
            "loss_k": r["loss_k"],
            "acc_k": r["acc_k"],
            "tau": simulated_acceptance_length(r["acc_k"]),
            "count_k": r["count_k"],
        }


def write_summary(out_dir: Path, metrics: Metrics, progress: Progress, total_steps: int, seconds: float,
                  n_trainable: int, last_eval: dict | None) -> None:  # fmt: skip
    """train/summary.json and train/curves.png (rank 0)."""
    if not dist.is_main():
        return
    from eaglekit.plots import training_curves  # lazy: heavy (plots imports matplotlib)

    summary: dict[str, Any] = {
        "steps": total_steps,
        "tokens": progress.tokens,
        "seconds": round(seconds, 1),
        "trainable_parameters": n_trainable,
        "best_tau": round(progress.best_tau, 4) if progress.best_tau >= 0 else None,
    }
    if last_eval:
        summary |= {"held_out_loss": last_eval["loss"], **{k: last_eval[k] for k in ("loss_k", "acc_k", "tau")}}
    atomic.write_json(out_dir / "summary.json", summary)
    training_curves(metrics.rows(), out_dir / "curves.png")
    if last_eval:
        say(
            f"train: held-out acc_k {[round(a, 3) for a in last_eval['acc_k']]}, "
            f"simulated acceptance length {last_eval['tau']:.3f}"
        )

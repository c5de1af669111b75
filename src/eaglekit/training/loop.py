"""The training loop of the train stage: build the drafter, run TTT on the target's features, evaluate, checkpoint.

Reads top to bottom: the drafter (fresh from the target's config, or finetuned from ``train.init_from``),
the feature source (the live target, or offline shards plus the target's lm_head), the optimizer and
schedule, then the loop — micro-batches, an optimizer step, logging, held-out evaluation, checkpoints.

Exact resume: micro-batch u of the run is a function of (seed, u) (``training/data.py``), and a checkpoint
holds parameters, optimizer, scheduler, step, the open logging window and the RNG states, so a run killed
after checkpoint S and resumed repeats steps S+1... exactly as the uninterrupted run does.

Checkpoints: ``train/checkpoints/step-N/`` (the drafter in the legacy form, so export is a copy, plus
``training_state.pt``), ``best/`` (by held-out simulated acceptance length) and ``latest`` (a pointer file).
Only rank 0 writes files; every rank computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eaglekit import atomic
from eaglekit.data.shards import FeatureStore, Rows, decode, plan_shards
from eaglekit.data.tokens import TokenStore
from eaglekit.data.vocab import load_vocab
from eaglekit.errors import EaglekitError
from eaglekit.interrupt import StopRequest
from eaglekit.model import checkpoints
from eaglekit.model.dflash import DFlashConfig
from eaglekit.model.drafter import DrafterConfig, Eagle3Drafter
from eaglekit.model.hub import drafter_folder
from eaglekit.model.target import (
    TargetFeatures,
    TargetHead,
    aux_layer_ids,
    embedding_and_head,
    load_target,
    target_hf_config,
)
from eaglekit.plots import training_curves
from eaglekit.progress import Meter, console
from eaglekit.training import distributed as dist
from eaglekit.training.data import (
    Batch,
    Loader,
    collate,
    collate_packed,
    epoch_batches,
    eval_batches,
    pack_length,
    packed_batches,
    rank_share,
    split_indices,
)
from eaglekit.training.dflash import block_objective, build_block_drafter, save_block_drafter, trains_block_drafter
from eaglekit.training.ttt import TTTOutput, simulated_acceptance_length, ttt_loss

STATE = "training_state.pt"


def say(message: str) -> None:
    """Print once per run: on rank 0 (every rank computes the same figures)."""
    if dist.is_main():
        console.print(message)


# ------------------------------------------------------------------------------------------------ drafter


def new_drafter(
    cfg, hf_config, d2t: torch.Tensor, t2d: torch.Tensor, embed: torch.Tensor, head: torch.Tensor, aux_ids: list[int]
) -> Eagle3Drafter:
    """A drafter shaped after the target (``train.draft`` overrides), with the target's embedding frozen in."""
    dcfg = DrafterConfig.from_target_config(
        hf_config, draft_vocab_size=int(d2t.numel()), aux_layer_ids=aux_ids, **cfg.train.draft.model_dump()
    )
    drafter = Eagle3Drafter(dcfg)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    take_target_embedding(drafter, embed)
    if cfg.train.init_lm_head_from_target:
        if head.shape[1] == dcfg.hidden_size:
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head[t2d.to(head.device)])
        else:
            say(
                f"[yellow]train: lm_head starts random: the target's rows are {head.shape[1]} wide, "
                f"the drafter's hidden size is {dcfg.hidden_size}[/]"
            )
    return drafter


def take_target_embedding(drafter: Eagle3Drafter, embed: torch.Tensor) -> None:
    """EAGLE-3 embeds tokens with the target's (frozen) embedding; a drafter of another width must learn its own."""
    if tuple(embed.shape) == tuple(drafter.embed_tokens.weight.shape):
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed)
        drafter.embed_tokens.weight.requires_grad_(False)
    else:
        say(
            f"[yellow]train: the target's embedding is {list(embed.shape)}, the drafter's "
            f"{list(drafter.embed_tokens.weight.shape)}: the drafter trains its own embedding[/]"
        )
        drafter.embed_tokens.weight.requires_grad_(True)


def remap_vocab(
    drafter: Eagle3Drafter, d2t: torch.Tensor, t2d: torch.Tensor, head: torch.Tensor | None
) -> tuple[Eagle3Drafter, int]:
    """The drafter on a new draft vocab: lm_head rows of tokens in both vocabs keep their weights, new rows come
    from the target's lm_head (when the widths match) or zero. Returns (new drafter, number of new rows)."""
    old_t2d = drafter.t2d.cpu()
    old_row = torch.cumsum(old_t2d.long(), 0) - 1  # draft row of each target id that the old vocab holds
    new_ids = t2d.nonzero().squeeze(1)
    cfg = dataclasses.replace(drafter.config, draft_vocab_size=int(new_ids.numel()))
    out = Eagle3Drafter(cfg)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    out.load_state_dict(state, strict=False)
    out.embed_tokens.weight.requires_grad_(drafter.embed_tokens.weight.requires_grad)
    kept = old_t2d[new_ids]
    with torch.no_grad():
        w = out.lm_head.weight
        if head is not None and head.shape[1] == w.shape[1]:
            w.copy_(head[new_ids])
        else:
            w.zero_()
        w[kept] = drafter.lm_head.weight.detach().cpu()[old_row[new_ids[kept]]]
        out.d2t.copy_(d2t)
        out.t2d.copy_(t2d)
    return out, int((~kept).sum())


def build_drafter(cfg, hf_config, d2t, t2d, embed, head, aux_ids) -> tuple[Eagle3Drafter, dict]:
    """Fresh, or ``train.init_from`` (its own d2t/t2d unless ``train.remap_vocab``); also says where the vocab came from."""
    if not cfg.train.init_from:
        drafter = new_drafter(cfg, hf_config, d2t, t2d, embed, head, aux_ids)
        has_rows = cfg.train.init_lm_head_from_target and head.shape[1] == drafter.config.hidden_size
        return drafter, {"draft_vocab": "vocab stage", "lm_head": freeze_head(drafter, cfg, has_rows)}
    drafter, _info = checkpoints.load_drafter(drafter_folder(cfg.train.init_from))  # a hub id: pre-flight fetched it
    drafter = drafter.float()
    if cfg.train.remap_vocab:
        drafter, new_rows = remap_vocab(drafter, d2t, t2d, head if cfg.train.init_lm_head_from_target else None)
        say(
            f"train: finetuning {cfg.train.init_from} on this run's draft vocab: {new_rows} of "
            f"{int(d2t.numel())} lm_head rows are new (from the target's lm_head, or zero), the rest keep their weights"
        )
        notes = {"draft_vocab": "vocab stage (remapped)", "new_lm_head_rows": new_rows}
        has_rows = new_rows == 0 or (cfg.train.init_lm_head_from_target and head.shape[1] == drafter.config.hidden_size)
    else:
        say(
            f"train: finetuning {cfg.train.init_from} with its own draft vocab ({drafter.config.draft_vocab_size} "
            "tokens); the vocab stage's mapping is not used (train.remap_vocab: true maps onto it)"
        )
        notes = {"draft_vocab": "init_from checkpoint"}
        has_rows = True
    take_target_embedding(drafter, embed)
    notes["lm_head"] = freeze_head(drafter, cfg, has_rows)
    return drafter, notes


def freeze_head(drafter: Eagle3Drafter, cfg, has_rows: bool) -> str:
    """train.freeze_lm_head: the draft head stays at the rows it starts from, when it has some ("frozen"), else
    it trains ("trained"). Trained, on the τ race against speculators (benchmarks/RESULTS.md), it drifted 38 %
    from the target's rows and cost 11 % of τ at K=5; frozen, the layer learns to speak the target's head.
    A head that starts random or zero must train, whatever the setting."""
    frozen = cfg.train.freeze_lm_head and has_rows
    drafter.lm_head.weight.requires_grad_(not frozen)
    if cfg.train.freeze_lm_head and not has_rows:
        say(
            "[yellow]train: lm_head trains although train.freeze_lm_head is set: it has no rows to start from "
            "(the target's lm_head is another width, or train.init_lm_head_from_target is false)[/]"
        )
    return "frozen" if frozen else "trained"


# ------------------------------------------------------------------------------------------ model wrapper


class TTT(nn.Module):
    """ttt_loss as a module's forward, so DDP / FSDP see a forward pass (their gradient sync hooks onto it).

    Under torchrun the loss of each TTT step is the sum over every rank's counted positions divided by their
    global count: each rank divides its own sum by the all-reduced count and multiplies by the world size,
    which the gradient averaging of DDP / FSDP divides out again. So ranks holding fewer counted positions
    weigh less, as they would in one process on the whole batch.

    ``anchor_weight`` > 0 adds the L2-SP pull toward the starting weights (Li et al. 2018):
    anchor_weight / 2 · ||θ - θ0||² over the trainable parameters, θ0 as they are when this module is built.
    """

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, anchor_weight: float = 0.0):
        super().__init__()
        self.drafter, self.steps, self.decay, self.anchor_weight = drafter, steps, decay, anchor_weight
        # not buffers: FSDP must not shard them, checkpoints must not hold them (they are the init_from weights)
        self.anchor = (
            {name: p.detach().clone() for name, p in drafter.named_parameters() if p.requires_grad}
            if anchor_weight > 0
            else {}
        )

    def forward(self, aux, input_ids, target_logits, loss_mask, attention_mask, target_in_draft, position_ids=None):
        world = dist.world_size() if dist.active() else 1
        out = ttt_loss(
            self.drafter,
            aux,
            input_ids,
            target_logits,
            loss_mask,
            attention_mask,
            self.steps,
            self.decay,
            target_in_draft,
            position_ids=position_ids,
            normalizer=(lambda count: dist.all_reduce_sum(count.clone())) if world > 1 else None,
        )
        loss = out.loss * world
        if out.count_k[0] == 0:  # nothing counted on this rank: touch every parameter so DDP's reduction completes
            loss = loss + sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        if self.anchor:
            params = dict(self.drafter.named_parameters())
            pull = sum(((params[name] - start) ** 2).sum() for name, start in self.anchor.items())
            out.anchor = float(pull.detach())
            loss = loss + 0.5 * self.anchor_weight * pull
        return loss, out


def wrap(module: nn.Module, mode: str, device: torch.device) -> nn.Module:
    if not dist.active():
        return module
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One unit: the drafter is one layer, and TTT calls its parts directly rather than through forward().
        return fully_shard(module, reshard_after_forward=False)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


# ---------------------------------------------------------------------------------------------- features


class Features:
    """Turns a token batch into TTT inputs: from the live target (online) or from shards + lm_head (offline)."""

    packing_checked = False  # online packing: the target's features of a packed document were checked once

    def __init__(
        self,
        run_dir: Path,
        t2d: torch.Tensor,
        device: torch.device,
        aux_ids: list[int],
        aux_dtype: torch.dtype,
        target_model=None,
        head: torch.Tensor | None = None,
    ):
        self.device, self.aux_dtype = device, aux_dtype
        self.store = None if target_model is not None else FeatureStore(run_dir / "extract")
        if target_model is not None:
            self.target = TargetFeatures(target_model, aux_ids, t2d)
        else:
            if self.store.index.get("aux_layer_ids") not in (None, aux_ids):
                raise EaglekitError(
                    f"the offline features tap layers {self.store.index['aux_layer_ids']}, this config {aux_ids}",
                    "rerun extraction: `eaglekit run CONFIG --from extract --force`",
                )
            weight = head.to(device, torch.float32 if device.type == "cpu" else head.dtype)
            self.head = TargetHead(weight, t2d)

    def __call__(self, batch: Batch) -> tuple:
        """(aux, input_ids, target_logits, loss_mask, attention_mask, target_in_draft, position_ids) on the device."""
        b = batch.to(self.device)
        if self.store is None:
            f = self.target(b.input_ids, b.attention_mask, position_ids=b.position_ids)
            if b.position_ids is not None and not self.packing_checked:
                self.check_packed_features(b, f)
            aux, logits, in_draft = (
                f.aux.to(self.device),
                f.target_logits.to(self.device),
                f.target_in_draft.to(self.device),
            )
        else:  # stored rows (bf16, or fp8 with its scales) are decoded on the device: half the bytes travel
            aux, last = decode(Rows(b.aux, b.last_hidden, b.scale_exp), self.head.weight.dtype)
            logits, in_draft = self.head(last)
        return aux.to(self.aux_dtype), b.input_ids, logits, b.loss_mask, b.attention_mask, in_draft, b.position_ids

    def check_packed_features(self, b: Batch, packed) -> None:
        """Once: the target's features of a packed row's second document equal those of the document alone.

        transformers keeps packed documents apart by reading position_ids; a model whose attention ignores
        them (custom code) would let every document attend the ones before it, silently.
        """
        for row in range(b.position_ids.shape[0]):
            starts = (b.position_ids[row] == 0).nonzero().squeeze(1).tolist()
            real = int(b.attention_mask[row].sum())
            if len(starts) >= 2 and starts[1] < real:
                end = starts[2] if len(starts) > 2 else real
                alone = self.target(b.input_ids[row : row + 1, starts[1] : end], with_logits=False)
                got, want = packed.aux[row, starts[1] : end].float(), alone.aux[0].float()
                error = float((got - want).norm() / want.norm().clamp(min=1e-12))
                if error > 0.05:
                    raise EaglekitError(
                        f"train.packing: the target's features of a packed document differ from the same document "
                        f"alone (relative error {error:.3f}): its attention does not keep packed documents apart "
                        "(transformers does that from position_ids for its own Llama/Qwen-style models)",
                        "set train.packing: false, or extract features offline (extract.mode: offline), which runs "
                        "every document alone",
                    )
                self.packing_checked = True
                return

    def blocks(self, store: TokenStore, lengths: list[int], shard_tokens: int) -> list[list[int]]:
        """Token-store indices per data block: the feature shards offline, the same plan online (one data order)."""
        if self.store is None:
            return plan_shards(lengths, shard_tokens)
        position = {sid: i for i, sid in enumerate(store.ids)}
        missing = [sid for sid in store.ids if sid not in self.store]
        if missing:
            raise EaglekitError(
                f"{len(missing)} prepared samples have no offline features (e.g. {missing[0]!r})",
                "the features are from other prepared tokens: rerun extraction: "
                "`eaglekit run CONFIG --from extract --force`",
            )
        return [[position[sid] for sid in ids if sid in position] for ids in self.store.shard_members()]


# ------------------------------------------------------------------------------------------- bookkeeping


class Window:
    """Token-weighted sums of the TTT figures over micro-batches (and ranks), between two log lines."""

    def __init__(self, steps: int, state: dict | None = None):
        self.steps = steps
        s = state or {}
        self.loss, self.micro = s.get("loss", 0.0), s.get("micro", 0)
        self.loss_k = list(s.get("loss_k", [0.0] * steps))
        self.correct_k = list(s.get("correct_k", [0.0] * steps))
        self.count_k = list(s.get("count_k", [0] * steps))
        self.tokens = s.get("tokens", 0)
        self.anchor = s.get("anchor", 0.0)

    def add(self, out: TTTOutput, loss: float, tokens: int) -> None:
        self.loss += loss
        self.micro += 1
        self.tokens += tokens
        self.anchor += out.anchor
        for k in range(self.steps):
            self.loss_k[k] += out.loss_k[k] * out.count_k[k]
            self.correct_k[k] += out.acc_k[k] * out.count_k[k]
            self.count_k[k] += out.count_k[k]

    def state(self) -> dict:
        return {
            "loss": self.loss,
            "micro": self.micro,
            "loss_k": self.loss_k,
            "correct_k": self.correct_k,
            "count_k": self.count_k,
            "tokens": self.tokens,
            "anchor": self.anchor,
        }

    def reduced(self) -> dict:
        """The figures summed over ranks: mean loss, per-step loss/accuracy, tokens, mean anchor distance²."""
        t = torch.tensor(
            [self.loss, self.micro, self.tokens, *self.loss_k, *self.correct_k, *self.count_k, self.anchor],
            dtype=torch.float64,
            device=_reduce_device(),
        )
        dist.all_reduce_sum(t)
        v = t.tolist()
        k = self.steps
        loss_k, correct_k, count_k = v[3 : 3 + k], v[3 + k : 3 + 2 * k], v[3 + 2 * k : 3 + 3 * k]
        return {
            "loss": v[0] / max(v[1], 1),
            "tokens": int(v[2]),
            "anchor": v[-1] / max(v[1], 1),
            "loss_k": [a / c if c else 0.0 for a, c in zip(loss_k, count_k, strict=False)],
            "acc_k": [a / c if c else 0.0 for a, c in zip(correct_k, count_k, strict=False)],
            "count_k": [int(c) for c in count_k],
        }


def _reduce_device() -> torch.device:
    # nccl reduces only CUDA tensors; gloo and the single process use the CPU
    return dist.device() if dist.active() and torch.cuda.is_available() else torch.device("cpu")


class Metrics:
    """train/metrics.jsonl: one JSON line per logged step and per eval, appended and fsynced (rank 0 only)."""

    def __init__(self, path: Path, tensorboard_dir: Path):
        self.path = path
        self.tb = None
        if dist.is_main():
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except Exception:  # tensorboard is optional
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps past the restored checkpoint, so no step is logged twice."""
        if not dist.is_main() or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):
                continue  # a line torn by the kill
        atomic.write_text(self.path, "".join(line + "\n" for line in keep))

    def write(self, row: dict) -> None:
        if not dist.is_main():
            return
        with atomic.naming_file(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            kind = row["kind"]
            for key in ("loss", "lr", "tau", "grad_norm"):
                if key in row:
                    self.tb.add_scalar(f"{kind}/{key}", row[key], row["step"])
            for k, acc in enumerate(row.get("acc_k", [])):
                self.tb.add_scalar(f"{kind}/acc_{k}", acc, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

    def rows(self) -> list[dict]:
        return (
            [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if self.path.exists()
            else []
        )


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine from 1 down to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------- checkpoints


def model_state(model: nn.Module, drafter: Eagle3Drafter, fsdp: bool) -> dict:
    """The drafter's full (unsharded) state dict on the CPU; a collective under FSDP, so every rank calls it."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("drafter."): v for k, v in msd.items()}
    return {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}


def optim_state(model: nn.Module, optim, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optim.state_dict()


def load_state(model: nn.Module, drafter: Eagle3Drafter, optim, msd: dict, osd: dict, fsdp: bool) -> None:
    """Restore parameters and optimizer; the frozen embedding is not in ``msd`` (it comes from the target)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)
        set_model_state_dict(model, {f"drafter.{k}": v for k, v in msd.items()}, options=opts)
        set_optimizer_state_dict(model, optim, osd, options=opts)
        return
    missing = drafter.load_state_dict(msd, strict=False).missing_keys
    if missing and missing != ["embed_tokens.weight"]:
        raise EaglekitError(f"the checkpoint lacks {missing}", "resume from an eaglekit checkpoint of this config")
    optim.load_state_dict(osd)


def without_frozen_embedding(msd: dict, drafter: Eagle3Drafter) -> dict:
    """What training_state.pt keeps of the model: all but the frozen embedding ([V, H], rebuilt from the target)."""
    frozen = not drafter.embed_tokens.weight.requires_grad
    return {k: v for k, v in msd.items() if not (frozen and k == "embed_tokens.weight")}


def save_drafter(drafter_cfg: DrafterConfig | DFlashConfig, msd: dict, out: Path) -> None:
    if isinstance(drafter_cfg, DFlashConfig):  # the block-drafter family
        save_block_drafter(drafter_cfg, msd, out)
        return
    cpu = Eagle3Drafter(drafter_cfg)
    cpu.load_state_dict(msd)
    checkpoints.save_legacy(cpu, out)


class Checkpoints:
    def __init__(self, folder: Path, keep_last: int):
        self.folder, self.keep_last = folder, keep_last

    def clean_partial(self) -> None:
        """Remove what a kill during a checkpoint write left behind (atomic_dir's temp and backup folders)."""
        for p in list(self.folder.glob(".*.tmp")) + list(self.folder.glob(".*.old")):
            shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.folder / "latest"
        if not pointer.exists():
            return None
        path = self.folder / pointer.read_text().strip()
        if not (path / STATE).exists():
            raise EaglekitError(
                f"{pointer} names {path.name}, which has no {STATE}",
                "remove the train folder's checkpoints/latest to restart, or restore that checkpoint",
            )
        return path

    def save(self, step: int, drafter_cfg: DrafterConfig, msd: dict, state: dict) -> Path:
        path = self.folder / f"step-{step}"
        with atomic.atomic_dir(path) as tmp:
            save_drafter(drafter_cfg, msd, tmp)
            torch.save(state, tmp / STATE)
        atomic.write_text(self.folder / "latest", path.name + "\n")
        steps = sorted(int(p.name.split("-")[1]) for p in self.folder.glob("step-*") if p.is_dir())
        for old in steps[: -self.keep_last]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        return path

    def save_best(self, step: int, drafter_cfg: DrafterConfig, msd: dict, figures: dict) -> None:
        with atomic.atomic_dir(self.folder / "best") as tmp:
            save_drafter(drafter_cfg, msd, tmp)
            atomic.write_json(tmp / "best.json", {"step": step, **figures})


def checkpoint_due(stop: StopRequest, last_save: float, minutes: float | None) -> tuple[bool, bool]:
    """(a signal asked to stop, train.save_every_minutes has passed), agreed by every rank: a checkpoint is a
    collective under FSDP, so no rank may decide alone."""
    flags = torch.tensor(
        [float(stop.requested), float(minutes is not None and time.monotonic() - last_save >= 60 * minutes)],
        dtype=torch.float64,
        device=_reduce_device(),
    )
    dist.all_reduce_sum(flags)
    return bool(flags[0] > 0), bool(flags[1] > 0)


# ------------------------------------------------------------------------------------------------ the run


@torch.no_grad()
def evaluate(
    model: nn.Module, features: Features, make_batch, batches: list[list], steps: int, decay: float, autocast
) -> dict:
    window = Window(steps)
    model.eval()
    for batch in batches:
        inputs = features(make_batch(rank_share(batch, dist.rank(), dist.world_size())))
        with autocast():
            loss, out = model(*inputs)
        window.add(out, float(loss.detach()), 0)
    model.train()
    r = window.reduced()
    return {
        "loss": sum(loss * decay**k for k, loss in enumerate(r["loss_k"])),
        "loss_k": r["loss_k"],
        "acc_k": r["acc_k"],
        "tau": simulated_acceptance_length(r["acc_k"]),
        "count_k": r["count_k"],
    }


def train(ctx) -> dict[str, Any]:
    cfg, tc = ctx.cfg, ctx.cfg.train
    dist.init()
    device, rank, world = dist.device(), dist.rank(), dist.world_size()
    fsdp = dist.active() and tc.distributed == "fsdp"
    out_dir = ctx.dir
    ckpts = Checkpoints(out_dir / "checkpoints", tc.keep_last)
    # rank 0 decides whether this resumes (the run directory is its to read); the others follow
    resume_from = None
    if dist.is_main():
        ckpts.clean_partial()
        latest = ckpts.latest() if ctx.resuming else None
        resume_from = str(latest) if latest else None
    resume_from = dist.broadcast(resume_from)

    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    store = TokenStore(ctx.run.stage_dir("prepare") / "tokens.safetensors")
    d2t, t2d = load_vocab(ctx.run.path)
    hf_config = target_hf_config(cfg.target)
    aux_ids = aux_layer_ids(cfg.target, hf_config.num_hidden_layers)
    online = cfg.extract.mode != "offline"
    target_model = load_target(cfg.target, device) if online else None
    embed, head = embedding_and_head(target_model if online else cfg.target.model, cfg.target.trust_remote_code)
    # dflash: the block-drafter family (training/dflash.py) takes the loop's inputs over the whole vocabulary
    block = trains_block_drafter(cfg)
    if block:
        drafter, notes = build_block_drafter(cfg, hf_config, embed, head, aux_ids)
    else:
        drafter, notes = build_drafter(cfg, hf_config, d2t, t2d, embed, head, aux_ids)
    drafter = drafter.to(device)
    # fp32 master weights; bf16 autocast on GPUs (train.dtype auto), fp32 on the CPU
    use_bf16 = tc.dtype == "bfloat16" or (tc.dtype == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    features = Features(
        ctx.run.path,
        torch.ones(head.shape[0], dtype=torch.bool) if block else drafter.t2d.cpu(),
        device,
        aux_ids,
        torch.bfloat16 if use_bf16 else torch.float32,
        target_model,
        head,
    )
    del embed, head

    # the figures per draft position: TTT steps, or a block's mask slots (weighted alike in the held-out loss)
    objective: nn.Module
    if block:
        objective = block_objective(drafter, tc.draft)
        positions, decay = drafter.config.block_size - 1, 1.0
    else:
        objective = TTT(drafter, tc.ttt_steps, tc.ttt_decay, tc.anchor_weight)
        positions, decay = tc.ttt_steps, tc.ttt_decay
    model = wrap(objective, tc.distributed, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)

    # data: micro-batch u of the run is batch u % per_epoch of epoch u // per_epoch; each rank takes its share
    lengths = store.lengths.tolist()
    train_idx, held_idx = split_indices(store, cfg.data.eval_fraction)
    if not train_idx:
        raise EaglekitError(
            f"no training samples: all {len(store)} are held out (data.eval_fraction {cfg.data.eval_fraction})",
            "lower data.eval_fraction or add data",
        )
    global_batch = tc.batch_size * world
    row_tokens = pack_length(cfg) if tc.packing else 0

    blocks = features.blocks(store, lengths, cfg.extract.shard_tokens)

    def plan(epoch: int) -> list[list]:
        """Each global batch: sample indices, or (packing) rows of sample indices; at least one entry per rank."""
        if tc.packing:
            batches = packed_batches(train_idx, lengths, global_batch, row_tokens, tc.seed, epoch, blocks)
        else:
            batches = epoch_batches(train_idx, lengths, global_batch, tc.seed, epoch, blocks)
        return [b for b in batches if len(b) >= world]

    def make_batch(
        entries: list, tokens: TokenStore = store, feature_store: FeatureStore | None = features.store
    ) -> Batch:
        return (collate_packed if tc.packing else collate)(tokens, entries, feature_store)

    per_epoch = len(plan(0))
    if per_epoch == 0:
        raise EaglekitError(
            f"{len(train_idx)} training samples make no batch for {world} processes", "add data or use fewer processes"
        )
    total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * per_epoch / tc.grad_accum))
    if tc.eval_samples and len(held_idx) > tc.eval_samples:
        held_idx = sorted(random.Random(tc.seed).sample(held_idx, tc.eval_samples))
    held_batches = [
        b
        for b in (
            packed_batches(held_idx, lengths, global_batch, row_tokens, 0, 0)
            if tc.packing
            else eval_batches(held_idx, lengths, global_batch)
        )
        if len(b) >= world
    ]
    if not held_batches:
        say(
            "[yellow]train: no held-out samples (data.eval_fraction is 0 or too small): "
            "no evaluation; best/ is the final drafter[/]"
        )
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: lr_factor(s, tc.warmup_steps, total_steps, tc.min_lr_ratio)
    )

    metrics = Metrics(out_dir / "metrics.jsonl", out_dir / "tensorboard")
    start_step, best_tau, window_state, tokens_seen, seconds_before = 0, -1.0, None, 0, 0.0
    if resume_from:
        state = torch.load(Path(resume_from) / STATE, map_location="cpu", weights_only=False)
        load_state(model, drafter, optim, state["model"], state["optimizer"], fsdp)
        sched.load_state_dict(state["scheduler"])
        start_step, best_tau, window_state = state["step"], state["best_tau"], state["window"]
        tokens_seen, seconds_before = state["tokens"], state["seconds"]
        set_rng_state(state["rng"])
        metrics.truncate_after(start_step)
        say(f"train: resumed from {resume_from} at step {start_step} of {total_steps}")
    elif dist.is_main():
        metrics.path.unlink(missing_ok=True)

    n_trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    batch_shape = f"{global_batch} rows of up to {row_tokens} packed tokens" if tc.packing else str(global_batch)
    say(
        f"train: {n_trainable / 1e6:.2f}M trainable parameters, {len(train_idx)} train / {len(held_idx)} "
        f"held-out samples, {per_epoch} batches of {batch_shape} per epoch, {total_steps} steps"
        f"{f' on {world} processes' if world > 1 else ''} ({'online' if online else 'offline'} features)"
    )

    def run_eval(step: int) -> dict | None:
        nonlocal best_tau
        if not held_batches:
            return None
        figures = evaluate(model, features, make_batch, held_batches, positions, decay, autocast)
        metrics.write({"kind": "eval", "step": step, **{k: figures[k] for k in ("loss", "loss_k", "acc_k", "tau")}})
        if figures["tau"] > best_tau:
            best_tau = figures["tau"]
            msd = model_state(model, drafter, fsdp)
            if dist.is_main():
                ckpts.save_best(step, drafter.config, msd, {"tau": figures["tau"], "acc_k": figures["acc_k"]})
        return figures

    last_eval = run_eval(0) if start_step == 0 else None
    window = Window(positions, window_state)
    epoch_cache: dict[int, list[list[int]]] = {}

    def micro_batch(u: int, tokens: TokenStore, feature_store: FeatureStore | None) -> Batch:
        """Micro-batch u of the run for this rank (read ahead by the Loader's thread)."""
        nonlocal epoch_cache
        epoch, pos = divmod(u, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: plan(epoch)}
        return make_batch(rank_share(epoch_cache[epoch][pos], rank, world), tokens, feature_store)

    t0, local_tokens = time.monotonic(), 0
    model.train()
    # Ctrl-C / SIGTERM finish the step in progress and write a checkpoint before stopping (a second one stops at once)
    stop = StopRequest(
        lambda name: say(
            f"[yellow]train: {name}: finishing this step and writing a checkpoint (send it again to stop at once)[/]"
        )
    )
    last_save = time.monotonic()
    with (
        stop,
        contextlib.closing(Loader(micro_batch, store, features.store)) as loader,
        Meter(
            "train" if dist.is_main() else f"train (rank {rank})", total=total_steps, unit="step", initial=start_step
        ) as meter,
    ):
        for step in range(start_step, total_steps):
            for a in range(tc.grad_accum):
                batch = loader.get(step * tc.grad_accum + a)
                inputs = features(batch)
                last_micro = a == tc.grad_accum - 1 or not hasattr(model, "no_sync")
                with contextlib.nullcontext() if last_micro else model.no_sync():
                    with autocast():
                        loss, out = model(*inputs)
                    (loss / tc.grad_accum).backward()
                window.add(out, float(loss.detach()), batch.tokens)
                local_tokens += batch.tokens
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
            lr = sched.get_last_lr()[0]
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            done = step + 1

            if done % tc.log_every == 0 or done == total_steps:
                r = window.reduced()
                tokens_seen += r["tokens"]
                metrics.write(
                    {
                        "kind": "train",
                        "step": done,
                        "epoch": round(done * tc.grad_accum / per_epoch, 4),
                        "loss": r["loss"],
                        "loss_k": r["loss_k"],
                        "acc_k": r["acc_k"],
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens": tokens_seen,
                        "seconds": round(seconds_before + time.monotonic() - t0, 2),
                        **({"anchor_distance": math.sqrt(r["anchor"])} if tc.anchor_weight else {}),
                    }
                )
                meter.fields.update(
                    loss=round(r["loss"], 4),
                    acc_0=round(r["acc_k"][0], 4),
                    tok_s=round(local_tokens * world / max(time.monotonic() - t0, 1e-9)),
                )
                window = Window(positions)
            if done % tc.eval_every == 0 or done == total_steps:
                last_eval = run_eval(done)
                if last_eval:
                    meter.fields.update(held_out_tau=round(last_eval["tau"], 3))
            stopping, timed = checkpoint_due(stop, last_save, tc.save_every_minutes)
            if done % tc.save_every == 0 or done == total_steps or stopping or timed:
                msd, osd = model_state(model, drafter, fsdp), optim_state(model, optim, fsdp)
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
                            "epoch": done * tc.grad_accum // per_epoch,
                            "data_position": done * tc.grad_accum % per_epoch,
                            "best_tau": best_tau,
                            "window": window.state(),
                            "tokens": tokens_seen,
                            "seconds": seconds_before + time.monotonic() - t0,
                            "rng": rng_state(),
                        },
                    )
                dist.barrier()
                last_save = time.monotonic()
            meter.update(1)
            if stopping:
                say(f"train: stopped after step {done} of {total_steps}; checkpoint step-{done} is written")
                metrics.close()
                stop.stop()
    metrics.close()
    seconds = seconds_before + time.monotonic() - t0

    if last_eval is None and held_batches:  # resumed after the final checkpoint: its eval is in the log
        logged = next((r for r in reversed(metrics.rows()) if r["kind"] == "eval" and r["step"] == total_steps), None)
        last_eval = dist.broadcast(logged) or run_eval(total_steps)
    if not held_batches:
        msd = model_state(model, drafter, fsdp)
        if dist.is_main():
            ckpts.save_best(total_steps, drafter.config, msd, {})
    summary = {
        "steps": total_steps,
        "tokens": tokens_seen,
        "seconds": round(seconds, 1),
        "trainable_parameters": n_trainable,
        "best_tau": round(best_tau, 4) if best_tau >= 0 else None,
    }
    if last_eval:
        summary |= {
            "held_out_loss": last_eval["loss"],
            "loss_k": last_eval["loss_k"],
            "acc_k": last_eval["acc_k"],
            "tau": last_eval["tau"],
        }
    if dist.is_main():
        atomic.write_json(out_dir / "summary.json", summary)
        training_curves(metrics.rows(), out_dir / "curves.png")
        if last_eval:
            say(
                f"train: held-out acc_k {[round(a, 3) for a in last_eval['acc_k']]}, "
                f"simulated acceptance length {last_eval['tau']:.3f}"
            )
    dist.barrier()
    counts = {
        "steps": total_steps,
        "train_samples": len(train_idx),
        "tokens": tokens_seen,
        "seconds": round(seconds, 1),
        **notes,
    }
    if last_eval:
        counts |= {"tau": round(last_eval["tau"], 3), "acc_k": [round(a, 3) for a in last_eval["acc_k"]]}
    return counts

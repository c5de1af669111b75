"""Checkpoints of a training run: ``step-N/`` (the drafter in the legacy form plus ``training_state.pt``), ``best/``
and the ``latest`` pointer; the model, optimizer and RNG state that make a resumed run repeat the uninterrupted one.

Under FSDP gathering the state is a collective: every rank calls ``model_state``/``optim_state``, rank 0 writes.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eaglekit import atomic
from eaglekit.errors import EaglekitError
from eaglekit.interrupt import StopRequest
from eaglekit.training import distributed as dist
from eaglekit.training.checkpoint_integrity import STATE, intact_resume_point
from eaglekit.training.metrics import reduce_device
from eaglekit.training.objective import Training


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


def model_state(model: nn.Module, drafter: nn.Module, fsdp: bool) -> dict:
    """The drafter's full (unsharded) state dict on the CPU; a collective under FSDP, so every rank calls it."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy (torch.distributed.checkpoint)
            StateDictOptions,
            get_model_state_dict,
        )

        msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("drafter."): v for k, v in msd.items()}
    return {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}


def optim_state(model: nn.Module, optim, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy (torch.distributed.checkpoint)
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optim.state_dict()


def load_state(model: nn.Module, drafter: nn.Module, optim, msd: dict, osd: dict, fsdp: bool) -> None:
    """Restore parameters and optimizer; the frozen embedding is not in ``msd`` (it comes from the target)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy (torch.distributed.checkpoint)
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


def without_frozen_embedding(msd: dict, drafter: nn.Module) -> dict:
    """What training_state.pt keeps of the model: all but the frozen embedding ([V, H], rebuilt from the target)."""
    frozen = not drafter.get_parameter("embed_tokens.weight").requires_grad
    return {k: v for k, v in msd.items() if not (frozen and k == "embed_tokens.weight")}


class Checkpoints:
    """``family`` writes the drafter of each checkpoint (in the form its export writes); without one, the
    checkpoints are only read."""

    def __init__(self, folder: Path, keep_last: int, family: Training | None = None):
        self.folder, self.keep_last, self.family = folder, keep_last, family

    def save_drafter(self, drafter_cfg: Any, msd: dict, out: Path) -> None:
        assert self.family is not None, "Checkpoints(family=...) to write"
        # Building the CPU copy initialises its weights from the global RNG: forked, so that writing a checkpoint
        # does not move the RNG the run goes on drawing from (a block drafter's anchors, the feature noise), which
        # the checkpoint stored before this draw and a resumed run restores.
        with torch.random.fork_rng(devices=[]):
            self.family.save_checkpoint(drafter_cfg, msd, out)

    def clean_partial(self) -> None:
        """Remove what a kill during a checkpoint write left behind (atomic_dir's temp and backup folders)."""
        for p in list(self.folder.glob(".*.tmp")) + list(self.folder.glob(".*.old")):
            shutil.rmtree(p, ignore_errors=True)

    def resume_point(self, resuming: bool) -> str | None:
        """Rank 0: the checkpoint a resumed run continues from, after removing what a killed write left behind."""
        self.clean_partial()
        latest = self.latest() if resuming else None
        if latest:  # checkpoint integrity: a damaged latest falls back to the newest intact one (or stops)
            latest = intact_resume_point(self.folder, latest)
        return str(latest) if latest else None

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

    def save(self, step: int, drafter_cfg: Any, msd: dict, state: dict) -> Path:
        path = self.folder / f"step-{step}"
        with atomic.atomic_dir(path, digests=True) as tmp:
            self.save_drafter(drafter_cfg, msd, tmp)
            with atomic.naming_file(tmp / STATE):  # torch's writer names no file: a full disk is named here
                torch.save(state, tmp / STATE)
        atomic.write_text(self.folder / "latest", path.name + "\n")
        steps = sorted(int(p.name.split("-")[1]) for p in self.folder.glob("step-*") if p.is_dir())
        for old in steps[: -self.keep_last]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        return path

    def save_best(self, step: int, drafter_cfg: Any, msd: dict, figures: dict) -> None:
        with atomic.atomic_dir(self.folder / "best", digests=True) as tmp:
            self.save_drafter(drafter_cfg, msd, tmp)
            atomic.write_json(tmp / "best.json", {"step": step, **figures})


def checkpoint_due(stop: StopRequest, last_save: float, minutes: float | None) -> tuple[bool, bool]:
    """(a signal asked to stop, train.save_every_minutes has passed), agreed by every rank: a checkpoint is a
    collective under FSDP, so no rank may decide alone."""
    flags = torch.tensor(
        [float(stop.requested), float(minutes is not None and time.monotonic() - last_save >= 60 * minutes)],
        dtype=torch.float64,
        device=reduce_device(),
    )
    dist.all_reduce_sum(flags)
    return bool(flags[0] > 0), bool(flags[1] > 0)

"""torchrun support, kept thin: torch.distributed does the work, this names the few calls the stages make.

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) ``init()`` starts the process group —
nccl on GPUs, gloo on CPU. Without it every helper degrades to the single-process case, so the stages
read the same either way. Only rank 0 writes files, the ledger and the run lock.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if active() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """This process's device: its own GPU under torchrun (LOCAL_RANK), else cuda:0 or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init() -> None:
    """Start the process group when launched by torchrun and not started yet."""
    if not launched() or active():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        dist.init_process_group("nccl", device_id=device())
    else:
        dist.init_process_group("gloo")


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t

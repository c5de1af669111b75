"""torchrun support, kept thin: torch.distributed does the work, this names the few calls the stages make.

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) ``init()`` starts the process group —
nccl on GPUs, gloo on CPU. Without it every helper degrades to the single-process case, so the stages
read the same either way. Only rank 0 writes files, the ledger and the run lock.

A fault of the machines rather than of eaglekit — a peer rank that died, a collective that timed out, a node that
never joined — surfaces as whatever torch.distributed raised (gloo's RuntimeErrors name no type of their own);
``fault`` recognises it, so that the stage stops with a message that says so and names this rank
(``failures.infrastructure_fault``).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglekit.errors import UsageError
from eaglekit.progress import console
from eaglekit.training.context_parallel import ContextGroup


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


# How long init waits for every rank to join and a collective for every rank to arrive; None: torch's defaults
# (10 minutes for NCCL, 30 for gloo). Tests shorten it.
TIMEOUT: datetime.timedelta | None = None


def init() -> None:
    """Start the process group when launched by torchrun and not started yet."""
    if not launched() or active():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        dist.init_process_group("nccl", device_id=device(), timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)


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


# ------------------------------------------------------------------------------------------ context parallel


def context_group(size: int) -> ContextGroup | None:
    """The ranks that split each row's positions with this one (train.context_parallel): ranks r*size .. r*size +
    size - 1 form group r, so a node's GPUs share a row. None for size 1. Every rank must call it (it creates the
    process groups)."""
    if size == 1:
        return None
    world = world_size()
    if not active() or world % size:
        raise UsageError(
            f"train.context_parallel is {size} but training runs on {world} process{'es' if world > 1 else ''}"
            + ("" if active() else " (not under torchrun)"),
            f"launch a multiple of {size} processes with torchrun (--nproc-per-node {size}), or set "
            "train.context_parallel: 1",
        )
    group, _ = dist.new_subgroups(group_size=size)
    return ContextGroup(group, rank() % size, size)


def data_parallel(context: ContextGroup | None) -> tuple[int, int]:
    """(the number of data-parallel groups, this rank's): the ranks of one context group read the same rows."""
    size = 1 if context is None else context.size
    return world_size() // size, rank() // size


# ------------------------------------------------------------------------------------------------- faults


def identity() -> str:
    """This process as the launcher named it: its rank, local rank and host."""
    env = os.environ
    world = f" of {env['WORLD_SIZE']}" if "WORLD_SIZE" in env else ""
    return f"rank {env.get('RANK', '?')}{world} (local rank {env.get('LOCAL_RANK', '?')} on {socket.gethostname()})"


@dataclass(frozen=True)
class Fault:
    """What a torch.distributed failure says happened: ``kind`` is "peer", "timeout" or "init"."""

    kind: str
    what: str  # in words, for the message
    detail: str  # the backend's own first line


# (kind, what happened in words, phrases of gloo's, NCCL's and the TCP store's messages), first match wins
FAULTS = (
    (
        "init",
        "the process group did not form: not every rank joined before the timeout (a node that never started its "
        "torchrun, a wrong MASTER_ADDR/MASTER_PORT, a firewall between the nodes)",
        ("waiting for clients", "clients joined", "trying to connect to", "socket has timed out"),
    ),
    (
        "timeout",
        "a collective timed out: another rank stopped answering (hung, stalled on I/O, or far slower than this one)",
        ("timed out", "timeout", "watchdog caught collective"),
    ),
    (
        "peer",
        "a peer rank died (killed, out of memory, crashed, or its node was lost)",
        (
            "connection closed by peer",
            "connection reset by peer",
            "remote worker crashing",
            "broken pipe",
            "remote process exited",
            "ncclremoteerror",
            "communicator was aborted",
            "ncclsystemerror",  # a socket or system call of NCCL's failed (not ncclUnhandledCudaError: a CUDA fault)
        ),
    ),
)


def fault(err: BaseException | None) -> Fault | None:
    """The distributed fault behind ``err`` (following its causes), or None when it is not one."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        backend = isinstance(err, dist.DistError) or any(
            mark in text for mark in ("gloo", "NCCL", "nccl", "ProcessGroup", "c10d")
        )
        if backend:
            lower = text.lower()
            for kind, what, phrases in FAULTS:
                if any(p in lower for p in phrases):
                    return Fault(kind, what, _first_line(text))
        err = err.__cause__ or err.__context__
    return None


def _first_line(text: str, limit: int = 240) -> str:
    line = (text.strip().splitlines() or [""])[0]
    line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line  # gloo's source location
    line = line.split(" This is typically caused by", 1)[0]  # gloo's advice, which the message replaces
    return line if len(line) <= limit else line[: limit - 1] + "…"


def say(message: str) -> None:
    """Print once per run: on rank 0 (every rank computes the same figures)."""
    if is_main():
        console.print(message)


def wrap(module: nn.Module, mode: str, device: torch.device) -> nn.Module:
    if not active():
        return module
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard  # lazy: heavy (torch.distributed.fsdp)

        # One unit: the drafter is one layer, and TTT calls its parts directly rather than through forward().
        return cast(nn.Module, fully_shard(module, reshard_after_forward=False))  # the module, its class extended

    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

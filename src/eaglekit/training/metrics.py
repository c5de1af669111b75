"""What training reports: token-weighted TTT figures between log lines, and ``train/metrics.jsonl`` (+ the trackers
train.report_to names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch
from rich.markup import escape

from eaglekit import atomic
from eaglekit.rundir import append_line
from eaglekit.training import distributed as dist
from eaglekit.training.figures import StepFigures
from eaglekit.training.trackers import Trackers, chosen, run_params

if TYPE_CHECKING:
    from eaglekit.training.trackers import Trackers


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

    def add(self, out: StepFigures, loss: float, tokens: int) -> None:
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
            device=reduce_device(),
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


def throughput(row: dict, before: tuple[int, float] | None) -> dict:
    """Tokens per second since the line before (``before``: its tokens and seconds; none: since the start), and the
    memory in use: the GPU's peak allocated by this process, else the process's resident memory."""
    tokens, seconds = (
        (row["tokens"] - before[0], row["seconds"] - before[1]) if before else (row["tokens"], row["seconds"])
    )
    if torch.cuda.is_available():
        memory = torch.cuda.max_memory_allocated() / 2**30
    else:
        memory = psutil.Process().memory_info().rss / 2**30
    return {"tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0, "memory_gib": round(memory, 3)}


def warn(message: str) -> None:
    dist.say(f"[yellow]warning: {escape(message)}[/]")


def reduce_device() -> torch.device:
    # nccl reduces only CUDA tensors; gloo and the single process use the CPU
    return dist.device() if dist.active() and torch.cuda.is_available() else torch.device("cpu")


class Metrics:
    """train/metrics.jsonl: one JSON line per logged step and per eval, appended and fsynced (rank 0 only), each line
    also handed to the run's experiment trackers (``training/trackers``: TensorBoard, trackio, wandb, MLflow). A
    train line gets the throughput since the line before it and the memory in use."""

    def __init__(self, path: Path):
        self.path = path
        self.trackers: Trackers | None = None
        self.lines = 0  # lines in the file: the index trackers know each line by
        self.last_train: tuple[int, float] | None = None  # (tokens, seconds) of the last train line

    def open_trackers(self, cfg, run_name: str, resume_step: int | None) -> None:
        """The trackers train.report_to names (its default: those installed and configured), continuing the tracker
        runs a resumed run logged to; after ``truncate_after`` on resume."""
        kept = self.rows() if resume_step is not None else None
        self.lines = len(kept or [])
        self.last_train = next(
            ((r["tokens"], r["seconds"]) for r in reversed(kept or []) if r.get("kind") == "train"), None
        )
        names = chosen(cfg.train.report_to)
        params = run_params(cfg) if names and dist.is_main() else {}
        self.trackers = Trackers.for_training(self.path.parent, names, run_name, params, kept, resume_step, warn)

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
        if row["kind"] == "train":
            row = row | throughput(row, self.last_train)
            self.last_train = (row["tokens"], row["seconds"])
        with atomic.naming_file(self.path):  # a failed append (disk full) is cut back: no torn line stays
            append_line(self.path, json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log_row(self.lines, row)
        self.lines += 1

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()

    def rows(self) -> list[dict]:
        return (
            [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if self.path.exists()
            else []
        )

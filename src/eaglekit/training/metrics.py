"""What training reports: token-weighted TTT figures between log lines, and ``train/metrics.jsonl`` (+ TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglekit import atomic
from eaglekit.rundir import append_line
from eaglekit.training import distributed as dist
from eaglekit.training.figures import StepFigures


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


def reduce_device() -> torch.device:
    # nccl reduces only CUDA tensors; gloo and the single process use the CPU
    return dist.device() if dist.active() and torch.cuda.is_available() else torch.device("cpu")


class Metrics:
    """train/metrics.jsonl: one JSON line per logged step and per eval, appended and fsynced (rank 0 only)."""

    def __init__(self, path: Path, tensorboard_dir: Path):
        self.path = path
        self.tb = None
        if dist.is_main():
            try:
                from torch.utils.tensorboard import SummaryWriter  # lazy: optional (tensorboard may be absent)

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
        with atomic.naming_file(self.path):  # a failed append (disk full) is cut back: no torn line stays
            append_line(self.path, json.dumps(row) + "\n")
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

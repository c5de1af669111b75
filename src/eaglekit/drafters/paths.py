"""Where a run's drafter is on disk, read from the config alone: export's fingerprint names it, and `eaglekit
status` takes that fingerprint without torch (``drafters.checked`` loads and checks the drafter there)."""

from __future__ import annotations

from pathlib import Path

from eaglekit.config import RunConfig


def checkpoint_path(cfg: RunConfig) -> Path:
    """The drafter this run evaluates and exports."""
    return Path(cfg.evaluate.checkpoint) if cfg.evaluate.checkpoint else cfg.run_path / "train" / "checkpoints" / "best"

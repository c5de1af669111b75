"""The draft vocabulary as the vocab stage writes it (vocab/vocab.safetensors): d2t and t2d."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglekit.errors import EaglekitError

VOCAB = "vocab.safetensors"


VOCAB = "vocab.safetensors"


def load_vocab(run_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as the vocab stage wrote them."""
    path = Path(run_dir) / "vocab" / VOCAB
    if not path.exists():
        raise EaglekitError(f"{path} does not exist", "pick the draft vocabulary: `eaglekit run CONFIG --until vocab`")
    t = load_file(str(path))
    return t["d2t"], t["t2d"]

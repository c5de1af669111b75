"""A drafter checkpoint folder's files, whatever its family: its config.json and its (sharded) weights, read with a
message naming the file when one is damaged; ``CheckpointInfo``, what a loaded checkpoint says besides its weights."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eaglekit.errors import EaglekitError, UsageError


@dataclass
class CheckpointInfo:
    form: str  # "legacy" or "speculators"
    path: Path
    missing_embeddings: bool  # embed_tokens absent: load the target's embedding before use
    aux_layer_ids: list[int] | None  # HF hidden_states indices; None = not pinned (servers use [2, N//2, N-3])
    verifier: str | None = None
    weight_files: list[str] = field(default_factory=list)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(
            f"{path}: cannot read JSON ({err})", "restore the file from the published checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object", "restore the file from the published checkpoint")
    return data


def load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise EaglekitError(f"{path} not found", "the checkpoint is incomplete; download it again")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise EaglekitError(f"{path}: cannot read weights ({err})", "the file is damaged; download it again") from None
    if not isinstance(state, dict):
        raise EaglekitError(f"{path}: expected a dict of tensors", "use the checkpoint's weight file")
    return state


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of a checkpoint folder: (sharded) model.safetensors, else (sharded) pytorch_model.bin."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = path / index_name
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UsageError(f"{index}: no weight_map", "restore the index file from the published checkpoint")
            files = sorted(set(weight_map.values()))
        elif (path / single).exists():
            files = [single]
        else:
            continue
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_weight_file(path / name))
        return state, files
    raise UsageError(
        f"{path}: no model.safetensors or pytorch_model.bin (sharded or not)",
        "point at the drafter's folder; training_state.pt alone holds no drafter weights",
    )


def layer_window(layer: dict) -> int | None:
    """The sliding window vLLM applies to the one draft layer of a config: ``sliding_window`` where
    ``layer_types[0]`` is "sliding_attention" (a window without layer_types is not applied)."""
    types = layer.get("layer_types")
    if isinstance(types, list) and types and types[0] == "sliding_attention" and layer.get("sliding_window"):
        return int(layer["sliding_window"])
    return None

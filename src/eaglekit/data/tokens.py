"""The prepare stage's output: every sample's token ids and loss mask, flat and columnar in one safetensors file.

Layout: ``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``offsets`` int64 [n+1] (sample i is
``[offsets[i], offsets[i+1])``); the metadata holds the format name and version, the sample ids (a JSON
list, in order) and the token counts. The header has to hold the ids, and safetensors caps it at 100 MB:
room for a few million samples. The reader memory-maps the file and reads one sample's slice at a time.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from safetensors import SafetensorError, safe_open

from eaglekit.atomic import atomic_path
from eaglekit.errors import EaglekitError

if TYPE_CHECKING:
    import torch

FORMAT = "eaglekit.tokens"
VERSION = "1"
REMEDY = (
    "remove the prepare folder, then `eaglekit run CONFIG --from prepare` writes it again (the same parameters "
    "make the same tokens, so the finished stages after it are kept)"
)


def write_token_store(path: str | os.PathLike, samples: Iterable[tuple[str, Sequence[int], Sequence[int]]]) -> int:
    """Write ``(id, input_ids, loss_mask)`` samples to ``path`` atomically; returns the number written."""
    import torch  # lazy: heavy (torch: `status` reads the lengths, below)
    from safetensors.torch import save_file  # lazy: heavy (torch)

    ids: list[str] = []
    tokens, mask = array("i"), array("B")
    offsets = array("q", [0])
    for sample_id, input_ids, loss_mask in samples:
        input_ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
        loss_mask = loss_mask.tolist() if hasattr(loss_mask, "tolist") else loss_mask
        if len(input_ids) != len(loss_mask):
            raise EaglekitError(f"sample {sample_id!r}: {len(input_ids)} token ids but {len(loss_mask)} mask values")
        tokens.extend(input_ids)
        mask.extend(loss_mask)
        offsets.append(len(tokens))
        ids.append(str(sample_id))
    if len(set(ids)) != len(ids):
        raise EaglekitError(f"{path}: duplicate sample ids in the token store")
    tensors = {
        "input_ids": torch.frombuffer(tokens, dtype=torch.int32) if tokens else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.frombuffer(mask, dtype=torch.uint8) if mask else torch.zeros(0, dtype=torch.uint8),
        "offsets": torch.frombuffer(offsets, dtype=torch.int64),
    }
    if tensors["loss_mask"].numel() and int(tensors["loss_mask"].max()) > 1:
        raise EaglekitError(f"{path}: loss masks must hold only 0 and 1")
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "ids": json.dumps(ids, ensure_ascii=False),
        "total_tokens": str(len(tokens)),
        "assistant_tokens": str(int(tensors["loss_mask"].sum())),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return len(ids)


class TokenStore:
    """Read a token store: ``store[i] -> (id, input_ids LongTensor [L], loss_mask uint8 [L])``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise EaglekitError(
                f"token store not found: {self.path}", "prepare the tokens: `eaglekit run CONFIG --until prepare`"
            )
        self._file: safe_open | None = None
        meta = self._open().metadata() or {}
        if meta.get("format") != FORMAT:
            self._corrupt(f"not an eaglekit token store (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            self._corrupt(f"token store version {meta.get('version')!r}, this eaglekit reads {VERSION!r}")
        try:
            self.ids: list[str] = json.loads(meta["ids"])
            self.total_tokens = int(meta["total_tokens"])
            self.assistant_tokens = int(meta["assistant_tokens"])
            self.offsets = self._open().get_tensor("offsets")
            shapes = {k: self._open().get_slice(k).get_shape() for k in ("input_ids", "loss_mask")}
        except (KeyError, ValueError, SafetensorError) as err:
            self._corrupt(f"incomplete metadata or tensors ({err})")
        offsets = self.offsets
        consistent = (
            len(offsets) == len(self.ids) + 1
            and int(offsets[0]) == 0
            and int(offsets[-1]) == self.total_tokens
            and shapes["input_ids"] == shapes["loss_mask"] == [self.total_tokens]
            and bool((offsets[1:] >= offsets[:-1]).all())
        )
        if not consistent:
            self._corrupt("the offsets, ids and token arrays do not agree")
        self.lengths = offsets[1:] - offsets[:-1]

    def _open(self) -> safe_open:
        if self._file is None:
            try:
                self._file = safe_open(str(self.path), framework="pt")
            except (SafetensorError, OSError) as err:
                self._corrupt(f"unreadable safetensors file ({err})")
        return self._file

    def _corrupt(self, what: str) -> NoReturn:
        raise EaglekitError(f"{self.path}: {what}: the file is truncated or corrupt", REMEDY)

    def __getstate__(self):  # DataLoader workers re-open the file themselves
        return {**self.__dict__, "_file": None}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        f = self._open()
        return self.ids[i], f.get_slice("input_ids")[start:end].long(), f.get_slice("loss_mask")[start:end]


def sample_lengths(path: str | os.PathLike) -> list[int]:
    """Each sample's token count, from the store's offsets alone and without torch: auto's window reads them when a
    command resolves a run (`eaglekit status` included). Raises EaglekitError where ``TokenStore`` would."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            meta = header.get("__metadata__") or {}
            start, end = header["offsets"]["data_offsets"]
            if header["offsets"]["dtype"] != "I64" or meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ValueError("not an eaglekit token store of this version")
            f.seek(8 + size + start)
            offsets = array("q", f.read(end - start))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise EaglekitError(
            f"{path}: unreadable token store ({err}): the file is truncated or corrupt", REMEDY
        ) from None
    if sys.byteorder != "little":
        offsets.byteswap()  # safetensors stores little-endian
    return [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]

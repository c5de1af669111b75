"""The draft vocabulary as the vocab stage writes it (vocab/vocab.safetensors): d2t and t2d, and what it was built
from.

The file's metadata records the sha256 of the prepared tokens it counted and the vocab settings (``built_from``),
so the record travels with the file: a vocabulary copied in from another run (its own tokens, its own coverage)
is refused before training instead of training silently on a draft vocabulary chosen for other data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from eaglekit import rundir
from eaglekit.errors import EaglekitError

if TYPE_CHECKING:
    import torch

VOCAB = "vocab.safetensors"
PREPARED_TOKENS = Path("prepare") / "tokens.safetensors"  # relative to the run directory
REBUILD = (
    "rebuild it from this run's tokens: `eaglekit vocab CONFIG --force` (reruns only vocab; prepare's tokens stay)"
)


def load_vocab(run_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as the vocab stage wrote them."""
    path = Path(run_dir) / "vocab" / VOCAB
    if not path.exists():
        raise EaglekitError(f"{path} does not exist", "pick the draft vocabulary: `eaglekit run CONFIG --until vocab`")
    from safetensors.torch import load_file  # lazy: heavy (torch: pre-flight reads this module's file names)

    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def tokens_sha256(path: str | Path) -> str:
    """The sha256 of a prepared token store (``RUN_DIR/prepare/tokens.safetensors``), hashed once and cached in its
    run directory by size, mtime and inode (rundir.run_digests)."""
    path = Path(path)
    return rundir.run_digests(path.parents[1], [path], "the prepared tokens")[path]


def built_from(run_dir: str | Path, settings: dict[str, Any]) -> dict[str, Any]:
    """What a vocabulary built now in ``run_dir`` is built from: its prepared tokens and the vocab settings."""
    tokens = Path(run_dir) / PREPARED_TOKENS
    return {"tokens": str(tokens), "tokens_sha256": tokens_sha256(tokens), "settings": settings}


def vocab_record(path: str | Path) -> dict[str, Any] | None:
    """The ``built_from`` record of a vocab file, or None when it has none (older eaglekit, or made by hand)."""
    with safe_open(str(path), "pt") as f:
        raw = (f.metadata() or {}).get("built_from")
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def vocab_origin(run_dir: str | Path, settings: dict[str, Any]) -> tuple[str, str, str]:
    """(status, detail, remedy) of the check that the run's vocabulary was built from the run's prepared tokens
    and its vocab settings: "fail" names both identities and the rebuild."""
    run_dir = Path(run_dir)
    path, tokens = run_dir / "vocab" / VOCAB, run_dir / PREPARED_TOKENS
    if not path.is_file() or not tokens.is_file():
        return "skip", f"{path if not path.is_file() else tokens} not there yet", ""
    try:
        record = vocab_record(path)
    except Exception as err:  # safetensors raises several kinds for a torn or foreign file
        return "fail", f"{path} is not a readable vocab file ({err})", REBUILD
    if record is None:
        return (
            "warn",
            f"{path} records no origin (written by an older eaglekit, or by hand): whether it was built from this "
            f"run's tokens cannot be told",
            REBUILD,
        )
    current = tokens_sha256(tokens)
    if record.get("tokens_sha256") != current:
        return (
            "fail",
            f"{path} was built from other prepared tokens ({record.get('tokens', '?')}, sha256 "
            f"{str(record.get('tokens_sha256'))[:16]}…) than this run's {tokens} (sha256 {current[:16]}…): "
            "another run's vocabulary, whose coverage of this run's tokens is unknown",
            REBUILD,
        )
    theirs = record.get("settings") or {}
    changed = sorted(k for k in set(theirs) | set(settings) if theirs.get(k) != settings.get(k))
    if changed:
        return (
            "fail",
            f"{path} was built with other vocab settings than the config's: "
            + ", ".join(f"{k} {theirs.get(k)!r} (now {settings.get(k)!r})" for k in changed),
            REBUILD,
        )
    return "ok", f"{path.name} built from this run's {tokens.name} (sha256 {current[:16]}…)", ""

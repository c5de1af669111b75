"""What the families' SGLang checks share: a folder's config.json and weight shapes, the accounting of which SGLang
parameter each weight fills, the refusal naming each key, and the launch command.

SGLang reads each config key with a default and skips a weight it has no parameter for, without a word (its
``load_weights`` in ``srt/models/*.py``), so a folder it would serve otherwise than written must be refused here.
The families restate SGLang's parameters and its name mapping (``drafters/dflash/sglang_form.py`` for the block
drafters, ``drafters/eagle3/sglang_form.py`` for EAGLE-3); tests/drafters/test_sglang_forms.py builds SGLang's own
classes from the sglang wheel on the CPU and pins both.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eaglekit.errors import EaglekitError

SGLANG_READ = "0.5.23"  # the SGLang release the forms were read from (the sglang wheel)


def lookup(config: dict, key: str) -> Any:
    """A key of config.json, "section.key" for a nested one; None when absent."""
    section, _, name = key.rpartition(".")
    holder = config.get(section) if section else config
    return holder.get(name) if isinstance(holder, dict) else None


def missing_keys(config: dict, required: tuple[str, ...]) -> list[str]:
    return [f"config.json lacks {key}" for key in required if lookup(config, key) is None]


def fill_problems(
    owner: str,
    params: dict[str, tuple[int, ...]],
    shapes: dict[str, tuple[int, ...]],
    landing: Callable[[str], str | None],
    ignored: Callable[[str], bool] = lambda name: False,
) -> list[str]:
    """Each weight landed in SGLang's parameter ``landing(key)`` (None: SGLang consumes it otherwise), stacked ones
    row by row: what would be skipped, mis-shaped or left unfilled, each naming its key. ``ignored`` parameters
    (the target's, or one refused already) are not accounted."""
    out: list[str] = []
    rows: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    for key, shape in shapes.items():
        name = landing(key)
        if name is None or ignored(name):
            continue
        if name not in params:
            out.append(f"weight {key} has no SGLang parameter ({owner}.load_weights skips it without a word)")
            continue
        if tuple(shape[1:]) != params[name][1:]:
            out.append(f"weight {key} has shape {list(shape)}, SGLang's {name} takes {list(params[name])}")
            continue
        rows[name] = rows.get(name, 0) + shape[0]
        keys.setdefault(name, []).append(key)
    for name, want in params.items():
        if ignored(name) or rows.get(name) == want[0]:
            continue
        filled = f"{rows[name]} rows ({', '.join(keys[name])})" if name in rows else "nothing"
        out.append(f"SGLang's {name} {list(want)} gets {filled} from the checkpoint")
    return out


def read_folder(folder: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """config.json and the weights' shapes (the tensors are not read)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118  (safe_open is not iterable)
    return config, shapes


def refuse(folder: Path, problems: list[str]) -> None:
    if problems:
        raise EaglekitError(
            f"{folder}: SGLang {SGLANG_READ} would not serve this drafter as written: " + "; ".join(problems),
            "re-export the drafter with eaglekit (the folder was changed or written by another tool)",
        )


def launch_command(target: str, algorithm: str, folder: Path, options: str) -> str:
    """``python -m sglang.launch_server`` with the flags ``srt/arg_groups/fields/spec.py`` defines."""
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {shlex.quote(str(folder.resolve()))} {options}"
    )

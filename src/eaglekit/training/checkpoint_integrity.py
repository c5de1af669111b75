"""Which checkpoint a resumed run may continue from: the latest one whose files are still the bytes written (their
digests, ``atomic.damage``), else the newest intact one before it — named, with the step it resumes from — else
none, and the run stops saying what to do. A damaged ``training_state.pt`` trains on from wrong weights without a
word; a damaged ``model.safetensors`` is what evaluate and export would read from that step: both are checked.
"""

from __future__ import annotations

from pathlib import Path

from eaglekit import atomic
from eaglekit.errors import EaglekitError
from eaglekit.progress import console

STATE = "training_state.pt"


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def step_folders(checkpoints: Path) -> list[Path]:
    """The ``step-N`` folders that hold a training state, newest first."""
    found = [p for p in checkpoints.glob("step-*") if p.is_dir() and p.name[5:].isdigit() and (p / STATE).exists()]
    return sorted(found, key=step_of, reverse=True)


def newest_intact(checkpoints: Path, latest: Path) -> Path | None:
    """``latest`` when its files are the bytes written, else the newest intact ``step-N`` before it, else None."""
    if not atomic.damage(latest):
        return latest
    earlier = [f for f in step_folders(checkpoints) if f != latest and step_of(f) <= step_of(latest)]
    return next((f for f in earlier if not atomic.damage(f)), None)


def intact_resume_point(checkpoints: Path, latest: Path) -> Path:
    """``latest`` when its files are intact; else the newest intact checkpoint before it, said on the terminal;
    else an EaglekitError naming each damaged file and the remedy."""
    intact = newest_intact(checkpoints, latest)
    if intact == latest:
        return latest
    damaged = atomic.damage(latest)
    if intact is not None:
        console.print(
            f"[yellow]train: checkpoint {latest.name} is damaged: {'; '.join(map(str, damaged))}; resuming "
            f"from {intact.name}, the newest intact checkpoint (step {step_of(intact)}; the steps after it are "
            "trained again)[/]"
        )
        return intact
    seen = {latest: damaged}
    for folder in step_folders(checkpoints):
        if folder != latest and step_of(folder) <= step_of(latest):
            seen[folder] = atomic.damage(folder)
    listed = "; ".join(f"{folder.name}: {'; '.join(map(str, found))}" for folder, found in seen.items())
    raise EaglekitError(
        f"train: no intact checkpoint to resume from in {checkpoints}: {listed}",
        f"restore {checkpoints} from a copy of the run, or remove it to train from the start (the rerun then "
        "starts at step 0)",
    )


def resume_words(checkpoints: Path, latest: Path | None) -> str:
    """Where a rerun resumes from, in words (what a stopped run's message says is kept)."""
    intact = newest_intact(checkpoints, latest) if latest else None
    if intact is None:
        return (
            f"no intact checkpoint ({latest.name} is damaged; a rerun says what to do)"
            if latest
            else "no checkpoint yet (a rerun starts over)"
        )
    damaged = f"; {latest.name} is damaged" if latest and intact != latest else ""
    return f"checkpoint {intact} (a rerun resumes from it{damaged})"


# Files a user may edit by hand on purpose (an exported config.json tried with another setting, a model card): read
# as they are now, with a note; the weights and the training state are refused when their bytes changed.
EDITABLE = (".json", ".md", ".txt", ".jinja", ".yaml")


def damaged_drafter(path: Path, what: str = "drafter") -> EaglekitError | None:
    """Why evaluate, export and verify must not read the drafter folder ``path`` (a weights file of it is not the
    bytes written, named), with what to do instead; None when its weights are intact or it carries no digests. A
    text file edited since is said, and read as it is."""
    found = atomic.damage(path)
    if found and all(d.file.suffix in EDITABLE for d in found):
        console.print(f"[yellow]{what} {path}: edited since it was written: {'; '.join(map(str, found))}[/]")
        return None
    if not found:
        return None
    if path.name == "best":
        intact = next((f for f in step_folders(path.parent) if not atomic.damage(f)), None)
        instead = f"set evaluate.checkpoint: {intact} (the newest intact checkpoint), or " if intact else ""
        remedy = f"{instead}restore {path} from a copy of the run"
    elif path.parent.name == "export":
        remedy = "rerun `eaglekit export CONFIG`: it writes a damaged form again from the checkpoint (seconds)"
    else:
        remedy = f"restore {path} from a copy, or point at another drafter"
    return EaglekitError(f"{what} {path} is damaged: " + "; ".join(map(str, found)), remedy)


def refuse_damaged_drafter(path: Path, what: str = "drafter") -> None:
    err = damaged_drafter(path, what)
    if err is not None:
        raise err

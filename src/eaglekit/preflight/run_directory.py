"""Pre-flight checks of the run directory, shared by every stage: the lock, the upstream stage, the output folder,
and the target folder's files. Each returns a CheckResult with its own message and remedy.

Stage-specific checks (a server's model id, a drafter's shapes) live with their stage; the other families
(files, dataset, disk, gpus, processes, environment) have a file each in this package.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from eaglekit import rundir
from eaglekit.contract import StageContext
from eaglekit.hub import cache_storage, hub_offline, is_hub_id, model_folder, split_id
from eaglekit.preflight import CheckResult, fail, ok, skip, warn, will_be_produced


def run_lock(ctx: StageContext) -> CheckResult:
    lock = ctx.run.lock
    h = lock.holder() or {}
    if lock.fd is not None or (h.get("pid") == os.getpid() and h.get("host") == socket.gethostname()):
        return ok("run lock", "held by this process")
    if lock.is_held_elsewhere():
        return fail(
            "run lock",
            f"held by pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('started', '?')}: "
            f"{h.get('command', '?')}",
            f"wait for it or stop it (kill {h.get('pid', 'PID')})",
        )
    return ok("run lock", "free")


def upstream_done(ctx: StageContext) -> CheckResult:
    """The stage this one reads finished with this config's fingerprint (``ctx.upstream``, from the pipeline)."""
    up = ctx.upstream
    if up is None:
        return skip("upstream", "first stage")
    pending = will_be_produced(ctx, "upstream", up)
    if pending:
        return pending
    done = ctx.run.done_fingerprint(up)
    if done is None or not ctx.run.is_done(up, done):
        return fail(
            "upstream",
            f"stage '{up}' has not finished in {ctx.run.path}",
            f"run the stages up to it: `{ctx.command_to_reach(up)}`",
        )
    if done != ctx.upstream_fingerprint:
        cause = ctx.stale_cause(up)
        if cause is None:
            return fail(
                "upstream",
                f"stage '{up}' finished with other inputs or parameters than this config's (stale)",
                f"rerun the stages up to it: `{ctx.command_to_reach(up)}`",
            )
        kept = (
            f"{', '.join(cause.kept)} stay{'s' * (len(cause.kept) == 1)} valid"
            if cause.kept
            else "no stage before it stays valid"
        )
        return fail(
            "upstream",
            f"stage '{up}' finished with other inputs or parameters than this config's (stale): since "
            f"{cause.changed_in} ran, " + "; ".join(cause.changes),
            f"rerun from {cause.stage}: `{cause.command}` ({kept})",
        )
    return ok("upstream", f"'{up}' done with this config's fingerprint")


def output_path(ctx: StageContext) -> CheckResult:
    """Classify the stage's output folder: each case gets its own message, never one generic fallback."""
    d: Path = ctx.dir
    name = "output folder"
    if d.is_symlink() and not d.exists():
        return fail(
            name,
            f"{d} is a broken symlink (points to {os.readlink(d)})",
            "recreate its target (e.g. mount the volume) or remove the link",
        )
    if not d.exists():
        parent = d.parent if d.parent.exists() else next((p for p in d.parents if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK):
            return fail(name, f"{d} does not exist and {parent} is not writable", "choose a run_dir you can write to")
        return ok(name, f"{d} will be created")
    if not d.is_dir():
        return fail(name, f"{d} exists and is not a folder", "move that file away or choose another run_dir")
    if not os.access(d, os.W_OK):
        return fail(name, f"{d} is not writable", f"fix its permissions (chmod u+w {d}) or choose another run_dir")
    state = ctx.run.folder_state(ctx.stage, ctx.fingerprint)
    if state == rundir.EMPTY:
        return ok(name, f"{d} is empty")
    if state == rundir.OWN:
        done = ctx.run.done_fingerprint(ctx.stage) == ctx.fingerprint
        return ok(
            name, f"{d} holds this config's {'finished' if done else 'partial'} data{'' if done else ' (will resume)'}"
        )
    goes_on = ctx.continues(state)
    if goes_on:
        return ok(name, f"{d} holds the outputs of other inputs, and {ctx.stage} goes on from them: {goes_on}")
    if state == rundir.FAILED_LEFTOVERS:
        return ok(name, f"{d} holds what a failed attempt with other parameters left: it will be replaced")
    refused = ctx.refusal(state)
    if refused:
        return fail(name, *refused)
    what = {
        rundir.OTHER_DONE: "the finished outputs of other parameters",
        rundir.FOREIGN: "files no eaglekit stage wrote",
        rundir.OTHER_PARTIAL: "the partial outputs of other parameters",
    }[state]
    return warn(name, f"{d} holds {what}; --force replaces them")


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def target_folder(ctx: StageContext) -> CheckResult:
    """The target has its config, tokenizer and (complete) weights — the same files from_pretrained reads."""
    model = ctx.cfg.target.model
    path = model_folder(model) or Path(model)  # a hub id in the cache: its snapshot, checked as a folder
    if not path.exists():
        if is_hub_id(model):
            storage = cache_storage(split_id(model)[0])
            if hub_offline():
                return fail(
                    "target folder",
                    f"{model} is a hub id with no snapshot in the Hugging Face cache ({storage}) and HF_HUB_OFFLINE "
                    "is set",
                    f"download it where the hub is reachable (`hf download {split_id(model)[0]}`), or point "
                    "target.model at its folder",
                )
            return warn(
                "target folder",
                f"{model} is a hub id with no snapshot in the local cache ({storage}); it will be downloaded",
                "download it ahead of a long run (`hf download`) and point target.model at the folder",
            )
        return fail("target folder", f"{model} does not exist", "set target.model to a Hugging Face model folder")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        missing.append("tokenizer files (tokenizer.json / tokenizer_config.json)")
    weights = [f for f in WEIGHT_FILES if (path / f).is_file()]
    if not weights:
        missing.append("weights (model.safetensors or a sharded index)")
    if missing:
        return fail(
            "target folder",
            f"{path} lacks {', '.join(missing)}",
            "point target.model at a complete Hugging Face model folder",
        )
    index = next((path / f for f in weights if f.endswith(".index.json")), None)
    if index is not None:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError) as err:
            return fail("target folder", f"{index} is unreadable ({err})", "re-download the model")
        absent = sorted(s for s in shards if not (path / s).is_file())
        if absent:
            return fail(
                "target folder",
                f"{path} misses {len(absent)} of {len(shards)} weight shards, e.g. {absent[0]}",
                "finish the download of the model",
            )
    try:
        cfg = json.loads((path / "config.json").read_text())
    except ValueError as err:
        return fail("target folder", f"{path / 'config.json'} is not valid JSON ({err})", "re-download the model")
    layers = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers")
    return ok("target folder", f"{path}: config, tokenizer, weights present ({layers} layers)")

"""Runs stages in order against a run directory: fingerprint, skip-if-done, pre-flight, ledger.

Each stage is a module in ``eaglekit.stages`` that declares ``STAGE = Stage(...)`` (``eaglekit.contract``: its
name, upstream, reads and writes, params, checks, run, when a config runs it, its estimate and optional hooks);
``STAGE_ORDER`` below lists them in order. The run order of a config, the upstream a stage reads, the CLI's
commands, `status` and `plan` all derive from those declarations.

A stage is *incomplete* from its ``start`` event until its ``end`` event, which is written only after its
outputs are committed; a rerun of a *done* stage with the same fingerprint is skipped, always (--force
only lets a stage replace outputs of other parameters). A stage that sees the run is degenerate says so
with ``ctx.warn``: the warning is printed, kept in the ledger and shown by `eaglekit status`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglekit import atomic, failures, preflight, rundir
from eaglekit.config import RunConfig
from eaglekit.contract import Stage, StageContext, StaleCause
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.preflight import disk, processes, run_directory
from eaglekit.preflight.files import INPUT_NAMES, moved_inputs
from eaglekit.progress import console
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir, content_identity, digest, tool_versions

# The stages in run order: adding a stage is its module (ending with `STAGE = Stage(...)`) and a line here.
STAGE_ORDER = ("generate", "prepare", "vocab", "extract", "train", "evaluate", "export", "verify")


def stage_of(name: str) -> Stage:
    """The declaration of stage ``name`` (its module's ``STAGE``)."""
    if name not in STAGE_ORDER:
        raise EaglekitError(f"unknown stage '{name}'", f"use one of: {', '.join(STAGE_ORDER)}")
    declared = importlib.import_module(f"eaglekit.stages.{name}").STAGE
    assert isinstance(declared, Stage) and declared.name == name, f"eaglekit.stages.{name}.STAGE is not its Stage"
    return declared


def stages_for(cfg: RunConfig) -> list[str]:
    """The stages this config runs, in order (each stage's ``runs_for``: extract offline only, verify if set)."""
    return [name for name in STAGE_ORDER if stage_of(name).runs_for(cfg)]


def upstream_of(cfg: RunConfig, stage: str) -> str | None:
    """The stage whose outputs ``stage`` reads: its declared upstream, stepping over stages this config skips."""
    up = stage_of(stage).upstream
    while up is not None and not stage_of(up).runs_for(cfg):
        up = stage_of(up).upstream
    return up


# The stages whose outputs the later stages read are one file, by the name read_identities gives it (and the stages
# that read it record): the stages after them are fingerprinted over its content, not over how it was made.
READ_BY_CONTENT = {"generate": "responses", "prepare": "tokens", "vocab": "vocab"}


class Fingerprints:
    """The fingerprints of one resolved run's stages, each taken once: the hash of the stage's parameters — the
    resolved values it consumes, under its own names (``Stage.params``) — and of what it reads of its upstream
    (``upstream_term``: the content of its file, or its fingerprint). A key
    renamed or moved in the config, or a rule reworded, leaves them as they were (a finished run stays done); a
    change to a value a stage computes with changes its fingerprint and those of the stages after it."""

    def __init__(self, run: ResolvedRun) -> None:
        self.run = run
        self._taken: dict[str, str] = {}

    def __call__(self, stage: str) -> str:
        if stage not in self._taken:
            params = stage_of(stage).params(self.run)
            self._taken[stage] = _hash(stage, params, self.upstream_term(stage, params))
        return self._taken[stage]

    def upstream_term(self, stage: str, reads: dict) -> str | None:
        """What the fingerprint of ``stage`` (with parameters ``reads``) takes of its upstream. Once an upstream of
        READ_BY_CONTENT is done with today's inputs: the content of its file where the stage reads it (its identity
        is among ``reads``), looking further up past the done files it does not read (extract reads prepare's tokens,
        not the vocabulary) — so an upstream rerun whose file came out the same leaves the stages after it done.
        Until then, and for a stage that reads none of those files, the upstream's fingerprint: the stages after a
        stale one are stale too."""
        up = upstream_of(self.run.cfg, stage)
        if up is None:
            return None
        walked: str | None = up
        while walked is not None:
            output = READ_BY_CONTENT.get(walked)
            if output is None or not RunDir(self.run.cfg.run_dir).is_done(walked, self(walked)):
                break
            if output in reads:
                return f"{output} {content_identity(reads[output])}"
            walked = upstream_of(self.run.cfg, walked)
        # a stage that reads none of the done files above it by content follows its upstream's fingerprint
        return self(up)


def fingerprint(cfg: RunConfig, stage: str) -> str:
    """The fingerprint of ``stage`` for ``cfg`` as it is now (``Fingerprints``)."""
    return Fingerprints(ResolvedRun(cfg))(stage)


def _hash(stage: str, params: dict, upstream: str | None) -> str:
    return digest({"stage": stage, "params": content_identity(params), "upstream": upstream})


def _as_recorded(params: dict) -> Any:
    """``params`` as the ledger holds them (JSON: tuples as lists, paths as strings)."""
    return json.loads(json.dumps(params, default=str))


def make_context(
    cfg: RunConfig, stage: str, force: bool = False, resolved: ResolvedRun | None = None, **options: Any
) -> StageContext:
    """The context ``stage`` is checked and run in, with the run resolved as it is now (after the stages before it
    in the same command wrote their outputs), or as ``resolved`` (a command that writes nothing in between, such as
    plan or a pre-flight of the whole pipeline, resolves once): its fingerprint, checks and run read that one."""
    resolved = resolved or ResolvedRun(cfg)
    fingerprints = Fingerprints(resolved)
    up = upstream_of(cfg, stage)
    run = RunDir(cfg.run_dir)
    return StageContext(
        cfg=cfg,
        run=run,
        stage=stage,
        fingerprint=fingerprints(stage),
        force=force,
        options=options,
        declared=stage_of(stage),
        stages=tuple(stages_for(cfg)),
        upstream=up,
        upstream_fingerprint=fingerprints(up) if up else None,
        reach=lambda target: command_to_reach(fingerprints, target),
        changes=lambda: changed_parameters(run, stage, resolved),
        stale_cause=lambda done: stale_cause(fingerprints, run, done),
        is_worker_rank=is_worker_rank(),
        resolution=resolved,
    )


def stage_checks(ctx: StageContext) -> list:
    """The generic checks around the stage's own: the run directory first, the disk last."""
    return [
        run_directory.run_lock,
        processes.other_processes,
        run_directory.upstream_done,
        run_directory.output_path,
        *ctx.stage_def.checks(ctx.cfg),
        disk.disk_space,
        disk.filesystem,
    ]


def run_preflight(ctx: StageContext) -> list[preflight.CheckResult]:
    return preflight.run_checks(ctx, stage_checks(ctx))


def preflight_pipeline(cfg: RunConfig) -> dict[str, list[preflight.CheckResult]]:
    """Pre-flight of the whole pipeline ahead of running it: each stage checked in order, as if the stages before
    it that have not finished (with this config's fingerprint) had run — their outputs "will be produced"."""
    report: dict[str, list[preflight.CheckResult]] = {}
    pending: list[str] = []
    resolved = ResolvedRun(cfg)  # nothing runs in between: one resolution for every stage's checks
    for stage in stages_for(cfg):
        ctx = make_context(cfg, stage, resolved=resolved)
        ctx.pending = tuple(pending)
        report[stage] = run_preflight(ctx)
        if not ctx.run.is_done(stage, ctx.fingerprint):
            pending.append(stage)
    return report


def is_worker_rank() -> bool:
    """Under torchrun only rank 0 owns the run directory (lock, ledger); the other ranks just compute."""
    return int(os.environ.get("RANK", "0")) != 0


def config_identity(cfg: RunConfig) -> dict[str, Any]:
    """Which file drove a run, and its content's hash: `eaglekit status RUN_DIR` compares against that file."""
    source = cfg.source
    if source is None or not Path(source).is_file():
        return {"source": None, "sha256": None}
    return {"source": str(source), "sha256": hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]}


# ------------------------------------------------------------------------------------------ running


def run_stages(
    cfg: RunConfig, stages: list[str], *, force: bool = False, skip_preflight: bool = False, **options: Any
) -> list[dict]:
    """Run ``stages`` in order under the run lock (rank 0), recording the invocation first; what `eaglekit run`,
    each stage command and the demo call."""
    run = RunDir(cfg.run_dir)
    if is_worker_rank():
        return [run_stage_as_worker(cfg, s, **options) for s in stages]
    command = " ".join(["eaglekit", *sys.argv[1:]])
    with run.lock.acquire(command=command):
        if not run.config_path.exists() or cfg.source != run.config_path.resolve():
            atomic.write_text(run.config_path, cfg.to_yaml())
        run.append_event(
            {
                "event": "invocation",
                "command": command,
                "stages": stages,
                "force": force,
                "config": config_identity(cfg),
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )
        return [run_stage(cfg, s, force=force, skip_preflight=skip_preflight, **options) for s in stages]


def run_stage(
    cfg: RunConfig, stage: str, *, force: bool = False, skip_preflight: bool = False, **options: Any
) -> dict[str, Any]:
    """Run one stage (the caller holds the run lock). Returns a summary row."""
    ctx = make_context(cfg, stage, force=force, **options)
    declared = ctx.stage_def
    # --retry-failed asks a finished generate to retry its failed samples, so it must not be skipped.
    if not options.get("retry_failed") and ctx.run.is_done(stage, ctx.fingerprint):
        problem = declared.damaged(ctx)
        if problem is None:
            console.print(
                f"[dim]{stage}: done with the same inputs and parameters, skipped "
                f"(to redo it anyway, remove {ctx.dir} first)[/]"
            )
            record_moved_inputs(ctx, _as_recorded(declared.params(ctx.resolved)))
            return {"stage": stage, "state": "done", "skipped": True}
        console.print(f"[yellow]{stage}: done, but {problem}: running it again to repair that (it resumes)[/]")

    if skip_preflight:
        results = [preflight.skip("preflight", "skipped by --skip-preflight")]
    else:
        results = run_preflight(ctx)
        bad = preflight.failed(results)
        if bad:
            console.print(preflight.results_table(results, title=f"pre-flight of {stage}"))
            ctx.run.append_event(
                {
                    "stage": stage,
                    "event": "preflight",
                    "fingerprint": ctx.fingerprint,
                    "preflight": [r.to_dict() for r in results],
                }
            )
            raise EaglekitError(
                f"{stage}: pre-flight failed: " + "; ".join(f"{r.name}: {r.detail.splitlines()[0]}" for r in bad),
                " / ".join(r.remedy for r in bad if r.remedy) or None,
            )
        warnings = [r for r in results if r.status == "warn"]
        if warnings:
            console.print(preflight.results_table(warnings, title=f"pre-flight of {stage}: warnings"))

    folder = ctx.run.folder_state(stage, ctx.fingerprint)
    refused = ctx.refusal(folder)
    if refused:  # pre-flight says so too; this holds when it was skipped
        raise EaglekitError(f"{stage}: {refused[0]}", refused[1])
    goes_on = ctx.continues(folder)
    if goes_on:
        console.print(f"{stage}: {goes_on}")
    elif folder not in (rundir.EMPTY, rundir.OWN):
        console.print(
            f"{stage}: replacing {ctx.dir} ({'what a failed attempt left' if folder == rundir.FAILED_LEFTOVERS else folder})"
        )
        shutil.rmtree(ctx.dir)
    ctx.dir.mkdir(parents=True, exist_ok=True)
    resuming = ctx.resuming
    ctx.run.write_marker(stage, ctx.fingerprint)
    ctx.run.append_event(
        {
            "stage": stage,
            "event": "start",
            "state": "incomplete",
            "fingerprint": ctx.fingerprint,
            "resume": resuming,
            "force": force,
            "skip_preflight": skip_preflight,
            "params": declared.params(ctx.resolved),
            "config": config_identity(cfg),
            "versions": tool_versions(),
            "preflight": [r.to_dict() for r in results],
        }
    )
    t0 = time.monotonic()
    console.print(f"[bold]{stage}[/]: started{' (resuming)' if resuming else ''}")
    try:
        counts = declared.run(ctx) or {}
    except BaseException as err:
        raise failures.record(ctx, err, round(time.monotonic() - t0, 2)) from None
    seconds = round(time.monotonic() - t0, 2)
    ctx.run.append_event(
        {
            "stage": stage,
            "event": "end",
            "state": "done",
            "fingerprint": ctx.fingerprint,
            "counts": counts,
            "seconds": seconds,
            "warnings": ctx.warnings,
            **ctx.ledger_extra,
        }
    )
    note = f" with {len(ctx.warnings)} warning{'s' * (len(ctx.warnings) > 1)}" if ctx.warnings else ""
    console.print(f"[bold green]{stage}[/]: done in {seconds:.1f}s{note} {counts}")
    return {"stage": stage, "state": "done", "counts": counts, "seconds": seconds, "warnings": ctx.warnings}


def record_moved_inputs(ctx: StageContext, today: dict) -> None:
    """A done stage whose inputs are now read from other paths, with the same content: said, and recorded in the
    ledger (an ``inputs moved`` event: the paths its run recorded are no longer where the config points)."""
    ran = [s.get("params") for s, _ in ctx.run.attempts(ctx.stage) if s.get("fingerprint") == ctx.fingerprint]
    moved = moved_inputs(ran[-1] if ran else None, today)
    if moved:
        console.print(f"[dim]{ctx.stage}: {'; '.join(moved)}[/]")
        if moved != recorded_moves(ctx.run, ctx.stage, ctx.fingerprint):
            ctx.run.append_event(
                {"stage": ctx.stage, "event": "inputs moved", "fingerprint": ctx.fingerprint, "moved": moved}
            )


def recorded_moves(run: RunDir, stage: str, fingerprint: str) -> list[str]:
    """The inputs of ``stage``, done with ``fingerprint``, that the ledger last recorded as moved (`status`)."""
    moves = [
        ev.get("moved") or []
        for ev in run.events()
        if ev.get("stage") == stage and ev.get("event") == "inputs moved" and ev.get("fingerprint") == fingerprint
    ]
    return moves[-1] if moves else []


def run_stage_as_worker(cfg: RunConfig, stage: str, **options: Any) -> dict[str, Any]:
    """A torchrun rank other than 0: compute only. Rank 0 holds the lock, runs the pre-flight and writes
    the ledger; the stage itself makes sure only rank 0 writes files."""
    ctx = make_context(cfg, stage, **options)
    if ctx.run.is_done(stage, ctx.fingerprint) and ctx.stage_def.damaged(ctx) is None:
        return {"stage": stage, "state": "done", "skipped": True}  # rank 0 skips it too: no collective to wait in
    try:
        counts = ctx.stage_def.run(ctx) or {}
    except Exception as err:  # this rank's view of a distributed fault is named too; rank 0 writes the ledger
        fault = failures.infrastructure_fault(ctx, err)
        if fault is None:
            raise
        raise fault from err
    return {"stage": stage, "state": "done", "counts": counts, "rank": int(os.environ.get("RANK", "0"))}


def select_stages(cfg: RunConfig, start: str | None = None, until: str | None = None) -> list[str]:
    order = stages_for(cfg)
    for name, flag in ((start, "--from"), (until, "--until")):
        if name is not None and name not in order:
            raise UsageError(f"{flag} {name}: not a stage of this run", f"use one of: {', '.join(order)}")
    lo = order.index(start) if start else 0
    hi = order.index(until) + 1 if until else len(order)
    if lo >= hi:
        raise UsageError(
            f"--from {start} comes after --until {until}: that selects no stage",
            f"stages run in this order: {', '.join(order)}",
        )
    return order[lo:hi]


NEEDS_FORCE = (rundir.OTHER_DONE, rundir.OTHER_PARTIAL, rundir.FOREIGN)


def run_command(
    cfg: RunConfig, fingerprints: Callable[[str], str], first: str, until: str | None = None, config: str = "CONFIG"
) -> str:
    """The one command that runs ``first`` .. ``until`` (done stages in between are skipped): with --force only
    when a stage in that range holds outputs of other parameters (``fingerprints``: each stage's, for ``cfg``)."""
    order = stages_for(cfg)
    span = order[order.index(first) : order.index(until) + 1 if until else len(order)]
    parts = ["eaglekit run", config]
    if first != order[0]:
        parts.append(f"--from {first}")
    if until and until != order[-1]:
        parts.append(f"--until {until}")
    run = RunDir(cfg.run_dir)
    if any(run.folder_state(s, fingerprints(s)) in NEEDS_FORCE for s in span):
        parts.append("--force")
    return " ".join(parts)


def command_to_reach(fingerprints: Fingerprints, stage: str, config: str = "CONFIG") -> str:
    """The whole way to a finished ``stage``, from the first stage before it that is not done."""
    cfg = fingerprints.run.cfg
    run = RunDir(cfg.run_dir)
    order = stages_for(cfg)
    first = next((s for s in order[: order.index(stage) + 1] if not run.is_done(s, fingerprints(s))), stage)
    return run_command(cfg, fingerprints, first, stage, config)


def changed_parameters(run: RunDir, stage: str, resolved: ResolvedRun) -> list[str] | None:
    """What differs between the parameters the stage last finished with (its ledger entry) and the resolved run's,
    as "input: old → new" lines; empty when only an upstream stage changed; None when the ledger does not say."""
    done = [start for start, end in run.attempts(stage) if end and end.get("state") == "done"]
    if not done or "params" not in done[-1]:
        return None
    old = _flatten(done[-1]["params"])
    new = _flatten(_as_recorded(stage_of(stage).params(resolved)))
    return [
        _change(stage, k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if content_identity(old.get(k)) != content_identity(new.get(k))
    ]


def stale_cause(fingerprints: Fingerprints, run: RunDir, stage: str) -> StaleCause | None:
    """Why finished ``stage`` is stale: the first stage up to it whose own parameters or inputs changed since it
    finished (a target's weights, the tokens, a setting), and the first stage finished with other inputs, from which
    the command reruns; None when no stage's ledger entry says what changed."""
    order = stages_for(fingerprints.run.cfg)
    upto = order[: order.index(stage) + 1] if stage in order else []
    stale = [s for s in upto if run.done_fingerprint(s) not in (None, fingerprints(s))]
    for s in stale:
        changes = changed_parameters(run, s, fingerprints.run)
        if changes:
            first = stale[0]
            kept = [k for k in order[: order.index(first)] if run.is_done(k, fingerprints(k))]
            return StaleCause(first, s, changes, run_command(fingerprints.run.cfg, fingerprints, first), kept)
    return None


def _change(stage: str, key: str, old: Any, new: Any) -> str:
    """One changed parameter in words: a recorded input by its name (preflight/files.INPUT_NAMES), a hash short."""
    for pattern, words in INPUT_NAMES:
        found = pattern.fullmatch(key)
        if found:
            hashed = isinstance(old, str | None) and isinstance(new, str | None) and "{field}" not in words
            shown = [
                ("sha256 " + v[:12] if v else "absent") if hashed else "unset (the default)" if v is None else _short(v)
                for v in (old, new)
            ]
            return f"{words.format(**found.groupdict())}: {shown[0]} → {shown[1]}"
    return f"{stage}.{key}: {_short(old)} → {_short(new)}"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and not ({"sha", "bytes"} & set(v)):  # a file identity stays one value
            out |= _flatten(v, key)
        else:
            out[key] = v
    return out


def _short(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, dict) and "path" in v:
        what = "missing" if v.get("missing") else "unreadable" if v.get("unreadable") else v.get("sha", "?")
        counted = "".join(f"{v[n]} {n}, " for n in ("prompts", "conversations") if n in v)
        return f"{v['path']} ({counted}{what})"
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:59] + "…"

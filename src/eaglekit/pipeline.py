"""Runs stages in order against a run directory: fingerprint, skip-if-done, pre-flight, ledger.

Each stage is a module in ``eaglekit.stages`` with:

    NAME      the stage's name
    UPSTREAM  the stage whose outputs it reads (None for the first)
    params(cfg) -> dict              what its outputs depend on (fingerprinted)
    checks(cfg) -> list[Check]       its own pre-flight checks (the generic ones are added here)
    estimate_bytes(ctx) -> int|None  optional: what it will write, for the disk check
    estimate_files(ctx) -> int|None  optional: how many files it creates, for the inode check
    estimate_write_rate(ctx) -> (bytes/s, why)|None   optional: the rate it writes at, for the write probe
    run(ctx) -> dict                 does the work; returns counts for the ledger and `status`

A stage is *incomplete* from its ``start`` event until its ``end`` event, which is written only after its
outputs are committed; a rerun of a *done* stage with the same fingerprint is skipped.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from eaglekit import preflight
from eaglekit.config import STAGES, RunConfig
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.progress import console
from eaglekit.rundir import RunDir, digest, tool_versions


def stage_module(name: str) -> ModuleType:
    if name not in STAGES:
        raise EaglekitError(f"unknown stage '{name}'", f"use one of: {', '.join(STAGES)}")
    return importlib.import_module(f"eaglekit.stages.{name}")


def upstream_of(cfg: RunConfig, stage: str) -> str | None:
    """The stage whose outputs ``stage`` reads (extract is skipped in online mode)."""
    up = stage_module(stage).UPSTREAM
    if up == "extract" and cfg.extract.mode != "offline":
        up = stage_module("extract").UPSTREAM
    return up


def fingerprint(cfg: RunConfig, stage: str, _memo: dict[str, str] | None = None) -> str:
    memo = {} if _memo is None else _memo
    if stage not in memo:
        up = upstream_of(cfg, stage)
        memo[stage] = digest({"stage": stage, "params": stage_module(stage).params(cfg),
                              "upstream": fingerprint(cfg, up, memo) if up else None})
    return memo[stage]


@dataclass
class StageContext:
    cfg: RunConfig
    run: RunDir
    stage: str
    fingerprint: str
    force: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    # Figures a stage wants in its ledger `end` event besides its counts (e.g. generate's gate figures).
    ledger_extra: dict[str, Any] = field(default_factory=dict)
    # What the pre-flight checks need from the registry, handed over so that they never import the pipeline.
    module: ModuleType | None = None
    upstream: str | None = None
    upstream_fingerprint: str | None = None
    # Stages that will run before this one: set only when the whole pipeline is pre-flighted ahead of a run,
    # so a check that needs their outputs says "will be produced by ..." instead of failing.
    pending: tuple[str, ...] = ()

    @property
    def dir(self):
        return self.run.stage_dir(self.stage)

    @property
    def resuming(self) -> bool:
        marker = self.run.read_marker(self.stage)
        return bool(marker and marker.get("fingerprint") == self.fingerprint and not self.force)


def make_context(cfg: RunConfig, stage: str, force: bool = False, **options: Any) -> StageContext:
    memo: dict[str, str] = {}
    up = upstream_of(cfg, stage)
    return StageContext(cfg=cfg, run=RunDir(cfg.run_dir), stage=stage, fingerprint=fingerprint(cfg, stage, memo),
                        force=force, options=options, module=stage_module(stage), upstream=up,
                        upstream_fingerprint=fingerprint(cfg, up, memo) if up else None)


def stage_checks(ctx: StageContext) -> list:
    """The generic checks around the stage's own: the run directory first, the disk last."""
    from eaglekit.preflight import checks as generic
    from eaglekit.preflight import disk, processes

    return [generic.run_lock, processes.other_processes, generic.upstream_done, generic.output_path,
            *ctx.module.checks(ctx.cfg), disk.disk_space, disk.filesystem]


def run_preflight(ctx: StageContext) -> list[preflight.CheckResult]:
    return preflight.run_checks(ctx, stage_checks(ctx))


def preflight_pipeline(cfg: RunConfig) -> dict[str, list[preflight.CheckResult]]:
    """Pre-flight of the whole pipeline ahead of running it: each stage checked in order, as if the stages before
    it that have not finished (with this config's fingerprint) had run — their outputs "will be produced"."""
    report, pending = {}, []
    for stage in cfg.stages():
        ctx = make_context(cfg, stage)
        ctx.pending = tuple(pending)
        report[stage] = run_preflight(ctx)
        if ctx.run.done_fingerprint(stage) != ctx.fingerprint:
            pending.append(stage)
    return report


def run_stage(cfg: RunConfig, stage: str, *, force: bool = False, skip_preflight: bool = False,
              **options: Any) -> dict[str, Any]:
    """Run one stage (the caller holds the run lock). Returns a summary row."""
    ctx = make_context(cfg, stage, force=force, **options)
    module = stage_module(stage)
    # --retry-failed asks a finished generate to retry its failed samples, so it must not be skipped.
    if not force and not options.get("retry_failed") and ctx.run.done_fingerprint(stage) == ctx.fingerprint:
        console.print(f"[dim]{stage}: done with the same inputs and parameters, skipped (--force reruns it)[/]")
        return {"stage": stage, "state": "done", "skipped": True}

    if skip_preflight:
        results = [preflight.skip("preflight", "skipped by --skip-preflight")]
    else:
        results = run_preflight(ctx)
        bad = preflight.failed(results)
        if bad:
            console.print(preflight.results_table(results, title=f"pre-flight of {stage}"))
            ctx.run.append_event({"stage": stage, "event": "preflight", "fingerprint": ctx.fingerprint,
                                  "preflight": [r.to_dict() for r in results]})
            raise EaglekitError(f"{stage}: pre-flight failed: " + "; ".join(f"{r.name}: {r.detail}" for r in bad),
                                " / ".join(r.remedy for r in bad if r.remedy) or None)
        warnings = [r for r in results if r.status == "warn"]
        if warnings:
            console.print(preflight.results_table(warnings, title=f"pre-flight of {stage}: warnings"))

    if ctx.force and ctx.dir.exists():
        shutil.rmtree(ctx.dir)
    ctx.dir.mkdir(parents=True, exist_ok=True)
    resuming = ctx.resuming
    ctx.run.write_marker(stage, ctx.fingerprint)
    ctx.run.append_event({"stage": stage, "event": "start", "state": "incomplete", "fingerprint": ctx.fingerprint,
                          "resume": resuming, "skip_preflight": skip_preflight, "versions": tool_versions(),
                          "preflight": [r.to_dict() for r in results]})
    t0 = time.monotonic()
    console.print(f"[bold]{stage}[/]: started{' (resuming)' if resuming else ''}")
    try:
        counts = module.run(ctx) or {}
    except BaseException as err:
        # An interrupt leaves resumable partial outputs (incomplete); anything else is a failure.
        interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
        ctx.run.append_event({"stage": stage, "event": "end", "state": "incomplete" if interrupted else "failed", "fingerprint": ctx.fingerprint,
                              "error": f"{type(err).__name__}: {err}", "seconds": round(time.monotonic() - t0, 2),
                              **ctx.ledger_extra})
        raise
    seconds = round(time.monotonic() - t0, 2)
    ctx.run.append_event({"stage": stage, "event": "end", "state": "done", "fingerprint": ctx.fingerprint,
                          "counts": counts, "seconds": seconds, **ctx.ledger_extra})
    console.print(f"[bold green]{stage}[/]: done in {seconds:.1f}s {counts}")
    return {"stage": stage, "state": "done", "counts": counts, "seconds": seconds}


def run_stage_as_worker(cfg: RunConfig, stage: str, force: bool = False, **options: Any) -> dict[str, Any]:
    """A torchrun rank other than 0: compute only. Rank 0 holds the lock, runs the pre-flight and writes
    the ledger; the stage itself makes sure only rank 0 writes files."""
    ctx = make_context(cfg, stage, force=force, **options)
    if not ctx.force and ctx.run.done_fingerprint(stage) == ctx.fingerprint:
        return {"stage": stage, "state": "done", "skipped": True}  # rank 0 skips it too: no collective to wait in
    counts = stage_module(stage).run(ctx) or {}
    return {"stage": stage, "state": "done", "counts": counts, "rank": int(os.environ.get("RANK", "0"))}


def select_stages(cfg: RunConfig, start: str | None = None, until: str | None = None) -> list[str]:
    order = cfg.stages()
    for name, flag in ((start, "--from"), (until, "--until")):
        if name is not None and name not in order:
            raise UsageError(f"{flag} {name}: not a stage of this run", f"use one of: {', '.join(order)}")
    lo = order.index(start) if start else 0
    hi = order.index(until) + 1 if until else len(order)
    return order[lo:hi]


# ------------------------------------------------------------------------------------------- status

NEXT_STEP = {
    "pending": "eaglekit {stage} CONFIG",
    "running": "wait; it is running (see its progress, or `eaglekit status` again)",
    "done": "",
    "failed": "read the error in the ledger, fix it, then: eaglekit {stage} CONFIG",
    "incomplete": "killed mid-run: eaglekit {stage} CONFIG resumes it",
    "stale": "its inputs or parameters changed: eaglekit {stage} CONFIG reruns it",
}


def status_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    """One row per stage: state, counts, when, and what to do next."""
    run = RunDir(cfg.run_dir)
    events = run.last_events()
    held = run.lock.is_held_elsewhere()
    memo: dict[str, str] = {}
    rows = []
    for stage in cfg.stages():
        ev = events.get(stage, {})
        start, end = ev.get("start"), ev.get("end")
        current = fingerprint(cfg, stage, memo)
        if start is None:
            state = "pending"
        elif end is None:
            state = "running" if held else "incomplete"
        elif end.get("state") in ("failed", "incomplete"):
            state = end["state"]
        elif end.get("fingerprint") != current:
            state = "stale"
        else:
            state = "done"
        counts = (end or {}).get("counts", {})
        live = getattr(stage_module(stage), "live_counts", None)
        if live is not None and state in ("running", "incomplete"):
            counts = live(run.stage_dir(stage))
        rows.append({
            "stage": stage,
            "state": state,
            "counts": counts,
            "started": (start or {}).get("ts"),
            "ended": (end or {}).get("ts"),
            "seconds": (end or {}).get("seconds"),
            "error": (end or {}).get("error"),
            "next": NEXT_STEP[state].format(stage=stage),
        })
    return rows

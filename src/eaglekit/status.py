"""`eaglekit status`: where a run stands, told truthfully, and the exact command that takes it further.

Per stage: its state (see ``rundir.STATES``), its main figures, when it ended, its last pre-flight, the
warnings it recorded, and bad data it can see (responses without reasoning, think tags left in replies, a
stage done with parameters that no longer match — and which ones). While a command holds the run lock, the
stage it is running shows ``running`` and the ones it will still run show ``queued``.

Which config: ``eaglekit status CONFIG`` compares the run against CONFIG; ``eaglekit status RUN_DIR``
against the config file that last drove the run (its path and hash are in the ledger), falling back to the
copy ``RUN_DIR/config.yaml`` when that file is gone — and it says which one it used.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from eaglekit import atomic, pipeline
from eaglekit.config import RunConfig, load_config
from eaglekit.errors import UsageError
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir

# The figures worth a glance, per stage (the rest are in --wide and --json).
HEADLINE = {
    "generate": ("done", "failed", "mean_output_tokens"),
    "prepare": ("samples", "tokens", "dropped"),
    "vocab": ("draft_vocab_size", "coverage"),
    "extract": ("shards", "tokens", "bytes"),
    "train": ("steps", "tau", "checkpoint"),
    "evaluate": ("eagle_tau_k1", "eagle_tau_k3", "eagle_tau_k5", "eagle_tau_k7", "prompts"),
    "export": ("formats",),
    "verify": ("verdict", "engine", "prompts"),
}


@dataclass
class Compared:
    cfg: RunConfig
    note: str  # which config the states are relative to, and why


def config_for(path: Path) -> Compared:
    """The config to judge the run by: ``path`` itself if it is a config file; for a run directory, the file that
    last drove it (as that file is now), else the run's own copy."""
    if not path.exists():
        raise UsageError(
            f"run directory not found: {path}", "pass the run_dir of a run (eaglekit demo makes runs/demo)"
        )
    if path.is_file():
        cfg = load_config(path)
        return Compared(cfg, f"compared with {path}")
    copy = path / "config.yaml"
    if not copy.exists():
        raise UsageError(
            f"{path} has no config.yaml, so it is not an eaglekit run directory",
            "pass the folder that `eaglekit run` or `eaglekit demo` wrote",
        )
    invocation = RunDir(path).last_invocation() or {}
    source = (invocation.get("config") or {}).get("source")
    if source and Path(source).resolve() != copy.resolve():
        if Path(source).is_file():
            cfg = load_config(source)
            if Path(cfg.run_dir).resolve() == path.resolve():
                edited = pipeline.config_identity(cfg)["sha256"] != invocation["config"].get("sha256")
                return Compared(
                    cfg,
                    f"compared with {source}, the config that last drove this run"
                    + (" (edited since)" if edited else ""),
                )
            return Compared(
                load_config(copy),
                f"compared with {copy}: {source}, which last drove this run, now "
                f"points at another run_dir ({cfg.run_dir})",
            )
        return Compared(load_config(copy), f"compared with {copy}: {source}, which last drove this run, is gone")
    return Compared(load_config(copy), f"compared with {copy}")


# ------------------------------------------------------------------------------------------- rows


def _ledger(
    run: RunDir,
) -> tuple[dict[str, list[tuple[int, dict, dict | None]]], tuple[int, dict] | None, dict[str, tuple[int, dict]]]:
    """One pass over the ledger: per stage its attempts (index, start, end), the last invocation, and per stage
    its last pre-flight (index, event: a `start` or a failed `preflight`)."""
    attempts: dict[str, list[tuple[int, dict, dict | None]]] = {}
    invocation = None
    preflights: dict[str, tuple[int, dict]] = {}
    for i, ev in enumerate(run.events()):
        kind, stage = ev.get("event"), ev.get("stage")
        if kind == "invocation":
            invocation = (i, ev)
        elif kind == "start" and stage:
            attempts.setdefault(stage, []).append((i, ev, None))
            if ev.get("preflight"):
                preflights[stage] = (i, ev)
        elif kind == "end" and stage and attempts.get(stage) and attempts[stage][-1][2] is None:
            j, start, _ = attempts[stage][-1]
            attempts[stage][-1] = (j, start, ev)
        elif kind == "preflight" and stage:
            preflights[stage] = (i, ev)
    return attempts, invocation, preflights


def preflight_summary(event: dict | None) -> dict[str, Any] | None:
    if not event:
        return None
    results = event.get("preflight") or []
    tally = {s: sum(r.get("status") == s for r in results) for s in ("ok", "warn", "fail", "skip")}
    return {
        "ts": event.get("ts"),
        **tally,
        "problems": [f"{r['name']}: {r.get('detail', '')}" for r in results if r.get("status") in ("warn", "fail")],
    }


def stage_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    """One row per stage: state, counts, when, why (stale / failed / removed), pre-flight, warnings, data flags."""
    run = RunDir(cfg.run_dir)
    attempts, invocation, preflights = _ledger(run)
    held = run.lock.is_held_elsewhere()
    live = invocation if held else None
    fingerprints = pipeline.Fingerprints(ResolvedRun(cfg))
    rows = []
    for stage in pipeline.stages_for(cfg):
        declared = pipeline.stage_of(stage)
        # never started: index -1, before any invocation
        index, start, end = attempts[stage][-1] if attempts.get(stage) else (-1, None, None)
        current = fingerprints(stage)
        reason = None
        if start is None:
            state = "pending"
        elif end is None:  # running, unless a killed earlier command left it so (then it can resume)
            state = "running" if held and (live is None or index > live[0]) else "incomplete"
        elif end.get("state") in ("failed", "incomplete"):
            state, reason = end["state"], end.get("error")
        elif end.get("fingerprint") != current:
            state = "stale"
            changes = pipeline.changed_parameters(run, stage, fingerprints.run)
            up = pipeline.upstream_of(cfg, stage)
            reason = (
                "its parameters or inputs changed"
                if changes is None
                else "; ".join(changes)
                if changes
                else f"its input, {up}, changed"
                if up
                else "its inputs changed"
            )
        elif not run.is_done(stage, current):
            state, reason = "pending", f"its folder {run.stage_dir(stage)} was removed or replaced"
        else:
            state = "done"
        if live and stage in live[1].get("stages", []) and state != "done" and index < live[0]:
            state = "queued"  # the command holding the lock will run it
        counts = (end or {}).get("counts") or {}
        so_far = declared.live_counts(run.stage_dir(stage)) if state in ("running", "incomplete") else None
        if so_far is not None:
            counts = so_far
        pf = preflights.get(stage)
        rows.append(
            {
                "stage": stage,
                "state": state,
                "counts": counts,
                "started": (start or {}).get("ts"),
                "ended": (end or {}).get("ts"),
                "seconds": (end or {}).get("seconds"),
                "error": (end or {}).get("error"),
                "log": (end or {}).get("log"),
                "reason": reason,
                "fingerprint": current,
                "preflight": preflight_summary(pf[1] if pf else None),
                "warnings": list((end or {}).get("warnings") or []),
                "flags": declared.data_flags(counts) if counts and state in ("done", "stale") else [],
                "damaged": damaged_files(run.stage_dir(stage)) if state != "pending" else [],
                "moved": pipeline.recorded_moves(run, stage, current) if state == "done" else [],
            }
        )
    return rows


def damaged_files(stage_dir: Path) -> list[str]:
    """The checkpoints and exported folders of a stage whose files are not the bytes written (their digests)."""
    return [str(d) for found in atomic.damaged_folders(stage_dir).values() for d in found]


# ---------------------------------------------------------------------------------------- commands


def next_steps(cfg: RunConfig, rows: list[dict], config: str) -> list[str]:
    """What to do now: a line or two, then the exact command on a line of its own (indented, never wrapped)."""
    run = RunDir(cfg.run_dir)
    running = [r for r in rows if r["state"] == "running"]
    queued = [r["stage"] for r in rows if r["state"] == "queued"]
    if running or queued:
        holder = run.lock.holder() or {}
        what = f"{running[0]['stage']} is running" if running else "a command holds the run"
        then = f"; then {', '.join(queued)}" if queued else ""
        return [
            f"{what} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}: {holder.get('command', '?')}){then}.",
            "`eaglekit status` again follows it.",
        ]
    todo = next((r for r in rows if r["state"] != "done"), None)
    if todo is None:
        export = run.stage_dir("export")
        return [
            f"nothing to run: every stage is done; the drafter is in {export}"
            if export.exists()
            else "nothing to run: every stage is done"
        ]
    stage, state = todo["stage"], todo["state"]
    fingerprints = {r["stage"]: r["fingerprint"] for r in rows}  # the run as stage_rows resolved it
    command = "  " + pipeline.run_command(cfg, fingerprints.__getitem__, stage, config=config)
    if state == "failed":
        return [
            f"{stage} failed: {todo['reason'] or 'see the ledger'}"
            + (f" (traceback in {todo['log']})" if todo.get("log") else ""),
            "Fix that, then (what the failed attempt left is replaced):",
            command,
        ]
    if state == "incomplete":
        return [f"{stage} was stopped mid-run; to resume it:", command]
    if state == "stale":
        after = [r["stage"] for r in rows[rows.index(todo) + 1 :]]
        ctx = pipeline.make_context(cfg, stage)
        goes_on = ctx.continues(run.folder_state(stage, ctx.fingerprint))  # generate with other prompts: what it keeps
        return [
            f"{stage} is stale: {todo['reason']}"
            + (f"; it goes on from its outputs: {goes_on}" if goes_on else "")
            + (f"; {', '.join(after)} follow it" if after else "")
            + ".",
            f"To rerun {stage}{' and what follows' if after else ''}, keeping the stages before it:",
            command,
        ]
    return ["next:", command]


# ----------------------------------------------------------------------------------------- display


def when(ts: str | None) -> str:
    """A timestamp short enough for the table: the time today, else the date too."""
    if not ts:
        return ""
    try:
        t = dt.datetime.fromisoformat(ts)
    except ValueError:
        return ts
    now = dt.datetime.now(t.tzinfo)
    return t.strftime("%H:%M") if t.date() == now.date() else t.strftime("%b %d %H:%M")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, list):
        return ",".join(_value(x) for x in v)
    return str(v)


def headline(stage: str, counts: dict, wide: bool = False) -> str:
    keys = (
        [k for k in counts if not isinstance(counts[k], dict)]
        if wide
        else [k for k in HEADLINE.get(stage, ()) if k in counts]
        or [k for k in counts if not isinstance(counts[k], (dict, list))][:3]
    )
    return ", ".join(
        f"{k.replace('eagle_tau_', 'τ ')} {_value(counts[k])}"
        if k.startswith("eagle_tau_")
        else f"{k} {_value(counts[k])}"
        for k in keys
    )


def relative(path: str | os.PathLike) -> str:
    """``path`` as short as it reads from the current folder."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if len(rel) < len(str(path)) else str(path)


def notes(rows: list[dict], config: str) -> list[str]:
    """Lines below the table: why a stage is stale, warnings, bad data, pre-flight problems."""
    out = []
    for r in rows:
        stage = r["stage"]
        if r["state"] == "pending" and r["reason"]:
            out.append(f"{stage}: {r['reason']}")
        for w in r["warnings"]:
            out.append(f"{stage}: warning: {w}")
        for f in r["flags"]:
            out.append(f"{stage}: {f.replace('CONFIG', config)}")
        for d in r.get("damaged", []):
            out.append(f"{stage}: damaged: {d}")
        for m in r.get("moved", []):
            out.append(f"{stage}: {m}")
        pf = r["preflight"]
        if pf and (pf["warn"] or pf["fail"]):
            out.append(
                f"{stage}: last pre-flight ({when(pf['ts'])}): {pf['fail']} fail, {pf['warn']} warn — "
                + "; ".join(pf["problems"][:2])
            )
    return out


def suite_lines(cfg: RunConfig, rows: list[dict], wide: bool = False) -> list[str]:
    """The benchmark-suite τ of evaluate's and verify's reports (``suites``), one line per suite, reasoning mode
    and temperature at the largest K (every K with --wide), to set beside a drafter's model card."""
    out = []
    for r in rows:
        if r["stage"] not in ("evaluate", "verify") or r["state"] not in ("done", "stale"):
            continue
        try:
            section = json.loads((Path(cfg.run_dir) / r["stage"] / "report.json").read_text()).get("suites") or {}
        except (OSError, ValueError):
            continue
        suite_rows = section.get("rows") or []
        kmax = max((s["k"] for s in suite_rows), default=0)
        for s in suite_rows:
            if wide or s["k"] == kmax:
                low, high = s["tau_ci95"]
                out.append(
                    f"{r['stage']}: {s['suite']}, reasoning {s['mode']}, K={s['k']}, T={s['temperature']:g}: "
                    f"τ {s['tau']:.2f} (95 % {low:.2f}–{high:.2f}, {s['prompts']} prompts)"
                )
    return out


STYLES = {
    "done": "green",
    "running": "cyan",
    "queued": "cyan",
    "failed": "red",
    "incomplete": "yellow",
    "stale": "magenta",
    "pending": "dim",
}


def render(console, compared: Compared, rows: list[dict], wide: bool = False) -> None:
    """The table (80 columns unless --wide), then notes and next steps below it."""
    cfg = compared.cfg
    config = relative(cfg.source) if cfg.source else "CONFIG"
    console.print(f"[bold]{relative(cfg.run_dir)}[/] — {compared.note}")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("stage", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("figures", overflow="fold", ratio=1)
    table.add_column("ended", no_wrap=True)
    if wide:
        for col in ("started", "seconds", "pre-flight", "warnings"):
            table.add_column(col, overflow="fold")
    for r in rows:
        cells = [
            r["stage"],
            f"[{STYLES[r['state']]}]{r['state']}[/]",
            headline(r["stage"], r["counts"], wide),
            when(r["ended"]) if r["state"] not in ("running", "queued") else "",
        ]
        if wide:
            pf = r["preflight"]
            cells += [
                when(r["started"]),
                "" if r["seconds"] is None else f"{r['seconds']:.0f}",
                f"{pf['ok']} ok, {pf['warn']} warn, {pf['fail']} fail ({when(pf['ts'])})" if pf else "",
                str(len(r["warnings"])) if r["warnings"] else "",
            ]
        table.add_row(*cells)
    console.print(table)
    for line in suite_lines(cfg, rows, wide):
        console.print(line, markup=False)
    for line in notes(rows, config):
        console.print(line, markup=False)
    for line in next_steps(cfg, rows, config):
        # a command stays whole on its line, to copy and paste; prose wraps
        console.print(line, markup=False, soft_wrap=line.startswith("  eaglekit"))

"""The `eaglekit` command: one subcommand per stage, plus demo / run / status / preflight / plan / tiny-target.

Exit codes: 0 success, 1 a check or stage failed, 2 usage / config / input error. Every command that
reports takes ``--json`` and then prints exactly one JSON document on stdout (human output goes to stderr).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from eaglekit import pipeline
from eaglekit.config import STAGES, RunConfig, load_config
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.progress import console
from eaglekit.rundir import RunDir

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train EAGLE-3 draft models end to end, checking ground truth before every long phase.")

JsonOpt = typer.Option(False, "--json", help="print one JSON document on stdout")
ForceOpt = typer.Option(False, "--force", help="rerun even if done; replace outputs of other parameters")
SkipOpt = typer.Option(False, "--skip-preflight", help="start without pre-flight checks (recorded in the ledger)")


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def is_worker_rank() -> bool:
    """Under torchrun only rank 0 owns the run directory (lock, ledger); the other ranks just compute."""
    return int(os.environ.get("RANK", "0")) != 0


def run_stages(cfg: RunConfig, stages: list[str], force: bool, skip_preflight: bool, **options: Any) -> list[dict]:
    run = RunDir(cfg.run_dir)
    if is_worker_rank():
        return [pipeline.run_stage_as_worker(cfg, s, force=force, **options) for s in stages]
    with run.lock.acquire(command=" ".join(["eaglekit", *sys.argv[1:]])):
        if not run.config_path.exists() or cfg.source != run.config_path.resolve():
            from eaglekit import atomic

            atomic.write_text(run.config_path, cfg.to_yaml())
        return [pipeline.run_stage(cfg, s, force=force, skip_preflight=skip_preflight, **options) for s in stages]


def _stage_command(stage: str):
    def command(config: Path = typer.Argument(..., help="the run config (YAML)"), force: bool = ForceOpt,
                skip_preflight: bool = SkipOpt, as_json: bool = JsonOpt) -> None:
        cfg = load_config(config)
        rows = run_stages(cfg, [stage], force, skip_preflight)
        if as_json:
            emit_json(rows[0])

    command.__name__ = stage
    command.__doc__ = f"Run the {stage} stage (after its pre-flight checks)."
    return command


for _stage in ("prepare", "vocab", "extract", "train", "evaluate", "verify"):
    app.command(_stage)(_stage_command(_stage))


@app.command("generate")
def generate_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"), force: bool = ForceOpt,
                 skip_preflight: bool = SkipOpt, as_json: bool = JsonOpt,
                 retry_failed: bool = typer.Option(False, "--retry-failed", help="retry the samples in errors.jsonl")) -> None:
    """Run the generate stage: collect the target's own responses, reasoning included."""
    cfg = load_config(config)
    rows = run_stages(cfg, ["generate"], force, skip_preflight, retry_failed=retry_failed)
    if as_json:
        emit_json(rows[0])


@app.command("export")
def export_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"), force: bool = ForceOpt,
               skip_preflight: bool = SkipOpt, as_json: bool = JsonOpt,
               fmt: str = typer.Option("", "--format", help="eagle3 | speculators | all (default: export.formats)")) -> None:
    """Write the drafter in the forms vLLM and SGLang load, and print the serve commands."""
    cfg = load_config(config)
    if fmt and fmt not in ("eagle3", "speculators", "all"):
        raise UsageError(f"--format {fmt}: unknown format", "use eagle3, speculators or all")
    formats = list(cfg.export.formats) if not fmt else (["eagle3", "speculators"] if fmt == "all" else [fmt])
    cfg.export.formats = formats  # part of the fingerprint: another --format is another export
    rows = run_stages(cfg, ["export"], force, skip_preflight, formats=formats)
    if as_json:
        emit_json(rows[0])


@app.command("run")
def run_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"),
            until: Optional[str] = typer.Option(None, "--until", help="last stage to run"),
            start: Optional[str] = typer.Option(None, "--from", help="first stage to run"),
            force: bool = ForceOpt, skip_preflight: bool = SkipOpt, as_json: bool = JsonOpt) -> None:
    """Run the stages in order: generate, prepare, vocab, extract (offline mode only), train, evaluate, export, verify
    (when verify.engine or verify.server is set)."""
    cfg = load_config(config)
    rows = run_stages(cfg, pipeline.select_stages(cfg, start, until), force, skip_preflight)
    if as_json:
        emit_json({"run_dir": cfg.run_dir, "stages": rows})


def _load_run_config(run_dir: Path) -> RunConfig:
    if not run_dir.exists():
        raise UsageError(f"run directory not found: {run_dir}", "pass the run_dir of a run (eaglekit demo makes runs/demo)")
    path = run_dir / "config.yaml" if run_dir.is_dir() else run_dir
    if not path.exists():
        raise UsageError(f"{run_dir} has no config.yaml, so it is not an eaglekit run directory",
                         "pass the folder that `eaglekit run` or `eaglekit demo` wrote")
    return load_config(path)


@app.command("status")
def status_cmd(run_dir: Path = typer.Argument(..., help="the run directory (or its config.yaml)"), as_json: bool = JsonOpt) -> None:
    """Where the run stands: one row per stage — state, counts, when, and what to do next."""
    cfg = _load_run_config(run_dir)
    rows = pipeline.status_rows(cfg)
    if as_json:
        emit_json({"run_dir": cfg.run_dir, "stages": rows})
        return
    from rich.table import Table

    table = Table(title=f"eaglekit run {cfg.run_dir}")
    for col in ("stage", "state", "counts", "ended", "next"):
        table.add_column(col, overflow="fold")
    styles = {"done": "green", "running": "cyan", "failed": "red", "incomplete": "yellow", "stale": "magenta", "pending": "dim"}
    for r in rows:
        counts = ", ".join(f"{k}={v}" for k, v in r["counts"].items())
        table.add_row(r["stage"], f"[{styles[r['state']]}]{r['state']}[/]", counts, r["ended"] or "",
                      r["next"].replace("CONFIG", str(cfg.source or "CONFIG")))
    console.print(table)


@app.command("preflight")
def preflight_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"),
                  stage: Optional[str] = typer.Option(None, "--stage", help="only this stage's checks, exactly as "
                                                      "`eaglekit STAGE` runs them (its upstream must have finished)"),
                  as_json: bool = JsonOpt) -> None:
    """Run the pre-flight checks alone (exit 1 on any fail).

    Without --stage, the whole pipeline is checked in order ahead of running it: a stage whose upstream has not
    run yet is not a failure, and the checks that need outputs still to be made say which stage produces them.
    """
    import time

    from eaglekit import preflight

    cfg = load_config(config)
    if stage and stage not in STAGES:
        raise UsageError(f"--stage {stage}: unknown stage", f"use one of: {', '.join(STAGES)}")
    t0 = time.monotonic()
    if stage:
        report = {stage: pipeline.run_preflight(pipeline.make_context(cfg, stage))}
    else:
        report = pipeline.preflight_pipeline(cfg)
    seconds = round(time.monotonic() - t0, 2)
    any_fail = any(preflight.failed(results) for results in report.values())
    if as_json:
        emit_json({"ok": not any_fail, "seconds": seconds,
                   "stages": {s: [r.to_dict() for r in results] for s, results in report.items()}})
    else:
        for s, results in report.items():
            console.print(preflight.results_table(results, title=f"pre-flight of {s}"))
        counts = {k: sum(r.status == k for rs in report.values() for r in rs) for k in preflight.STATUSES}
        console.print(f"pre-flight: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, "
                      f"{counts['skip']} skip in {seconds:.1f} s")
    if any_fail:
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"),
             samples: Optional[int] = typer.Option(None, "--samples", min=1, help="plan for this many samples"),
             mean_tokens: Optional[float] = typer.Option(None, "--mean-tokens", min=1, help="tokens per sample (prompt + reply)"),
             gen_tok_per_s: Optional[float] = typer.Option(None, "--gen-tok-per-s", min=0.001,
                                                           help="reply tokens per second over all servers"),
             extract_tok_per_s: Optional[float] = typer.Option(None, "--extract-tok-per-s", min=0.001,
                                                               help="tokens per second of the target's forward (extract)"),
             train_tok_per_s: Optional[float] = typer.Option(None, "--train-tok-per-s", min=0.001,
                                                             help="tokens per second of training"),
             free: Optional[str] = typer.Option(None, "--free-bytes", help="plan for this much free space (e.g. 2.8TB) "
                                                "instead of what the run directory's disk has"),
             write_mb_per_s: Optional[float] = typer.Option(None, "--write-mb-per-s", min=0.001,
                                                            help="the disk's write rate instead of probing it"),
             as_json: bool = JsonOpt) -> None:
    """Time, bytes, peak disk and write rate per stage, and whether the run fits (exit 1 when it does not).

    Figures measured in this run directory (a pilot with a small data.max_samples) are used unless a flag
    gives them; each figure says where it comes from.
    """
    from eaglekit.planning import parse_bytes, plan, render

    cfg = load_config(config)
    try:
        free_bytes = parse_bytes(free) if free is not None else None
    except ValueError as err:
        raise UsageError(f"--free-bytes: {err}", "e.g. --free-bytes 2.8TB") from None
    doc = plan(cfg, samples=samples, mean_tokens=mean_tokens, gen_tok_per_s=gen_tok_per_s,
               extract_tok_per_s=extract_tok_per_s, train_tok_per_s=train_tok_per_s, free_bytes=free_bytes,
               write_bytes_per_s=write_mb_per_s * 1e6 if write_mb_per_s else None)
    if as_json:
        emit_json(doc)
    else:
        console.print(render(doc))
    if doc["verdict"] == "does not fit":
        raise typer.Exit(1)


@app.command("serve-command")
def serve_command_cmd(config: Path = typer.Argument(..., help="the run config (YAML)"), as_json: bool = JsonOpt) -> None:
    """Print the command that starts a vLLM feature server for this config (extract.backend: vllm)."""
    from eaglekit.stages.extract import vllm_serve_command

    command = vllm_serve_command(load_config(config))
    if as_json:
        emit_json({"command": command})
    else:
        sys.stdout.write(command + "\n")


@app.command("tiny-target")
def tiny_target_cmd(out_dir: Path = typer.Argument(..., help="folder to write the model into"),
                    seed: int = typer.Option(0, help="training seed"), as_json: bool = JsonOpt) -> None:
    """Write the built-in tiny target (a trained reasoning-style Llama) in Hugging Face format."""
    from eaglekit.tiny import build_tiny_target

    path = build_tiny_target(out_dir, seed=seed)
    if as_json:
        emit_json({"path": str(path)})
    else:
        console.print(f"tiny target written to {path}")


@app.command("demo")
def demo_cmd(run_dir: Path = typer.Option(Path("runs/demo"), "--run-dir", help="where the demo run lives"),
             force: bool = ForceOpt, as_json: bool = JsonOpt,
             offline: bool = typer.Option(False, "--offline", help="extract the features to disk, then train from them")) -> None:
    """The whole pipeline on the built-in tiny target, on CPU: writes RUN_DIR/config.yaml, runs every stage."""
    from eaglekit.demo import run_demo

    summary = run_demo(run_dir, force=force, offline=offline)
    if as_json:
        emit_json(summary)


def main(argv: list[str] | None = None) -> None:
    try:
        # Without standalone mode click returns (rather than raises) the code of typer.Exit and of Ctrl-C.
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:
            if rc == 130:
                console.print("interrupted: everything completed so far is on disk; rerun the same command to resume")
            sys.exit(rc)
    except EaglekitError as err:
        console.print(f"[bold red]error:[/] {err.message}")
        if err.remedy:
            console.print(f"[bold]what to do:[/] {err.remedy}")
        sys.exit(err.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        console.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        console.print("interrupted: everything completed so far is on disk; rerun the same command to resume")
        sys.exit(130)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()

"""The `eaglekit` command: `run` and one command per stage, plus status / preflight / plan / demo / tiny-target.

Exit codes: 0 success, 1 a check or stage failed, 2 usage / config / input error, 130 Ctrl-C, 143 SIGTERM.
Every command that reports takes ``--json`` and then prints exactly one JSON document on stdout (progress
goes to stderr). Errors are a short message and what to do — never a traceback, unless ``--debug``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from eaglekit import __version__, adapt, failures, interrupt, pipeline, preflight, status, watch
from eaglekit.config import RunConfig, load_config
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.progress import console
from eaglekit.rundir import RunDir
from eaglekit.serving.engine import find_vllm_python

app = typer.Typer(
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    help="Train EAGLE-3 draft models end to end, checking ground truth before every long phase.",
)

STAGE_NAMES = " | ".join(pipeline.STAGE_ORDER)
JsonOpt = typer.Option(False, "--json", help="print one JSON document on stdout")
ForceOpt = typer.Option(
    False,
    "--force",
    help="let a stage replace outputs of other parameters (a stage done with the same ones is never rerun)",
)
SkipOpt = typer.Option(False, "--skip-preflight", help="start without pre-flight checks (recorded in the ledger)")
ConfigArg = typer.Argument(..., metavar="CONFIG", help="the run config (YAML)", show_default=False)


class _State:
    debug = bool(os.environ.get("EAGLEKIT_DEBUG"))
    config: str | None = None  # the config path as the user typed it, for exact remedies
    run_dir: str | None = None  # where a traceback log goes


def load(config: Path) -> RunConfig:
    cfg = load_config(config)
    _State.config, _State.run_dir = str(config), cfg.run_dir
    return cfg


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


class _Interrupted(Exception):
    """Carries a Ctrl-C / SIGTERM past click, which would reduce it to a bare exit code."""

    def __init__(self, original: KeyboardInterrupt):
        super().__init__("interrupted")
        self.original = original


def command(name: str, **kwargs):
    """``app.command`` whose Ctrl-C reaches ``main`` intact (to say what was kept, and exit 130 or 143)."""

    def register(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            try:
                return fn(*args, **kw)
            except KeyboardInterrupt as err:
                raise _Interrupted(err) from err

        return app.command(name, **kwargs)(wrapper)

    return register


def _version(value: bool) -> None:
    if value:
        typer.echo(f"eaglekit {__version__}")  # not the installed metadata: a source tree on PYTHONPATH has none
        raise typer.Exit()


@app.callback()
def options(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="print the version and exit"
    ),
    debug: bool = typer.Option(
        False,
        "--debug",
        help="print the full traceback of an unexpected error (it always goes to a log file under the run directory)",
    ),
) -> None:
    _State.debug = _State.debug or debug


# ------------------------------------------------------------------------------------------ stages


@command("run")
def run_cmd(
    config: Path = ConfigArg,
    start: str | None = typer.Option(None, "--from", metavar="STAGE", help=f"first stage to run: {STAGE_NAMES}"),
    until: str | None = typer.Option(None, "--until", metavar="STAGE", help=f"last stage to run: {STAGE_NAMES}"),
    force: bool = ForceOpt,
    skip_preflight: bool = SkipOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run the stages in order — generate, prepare, vocab, extract (offline mode only), train, evaluate, export,
    verify (when verify.engine or verify.server is set) — skipping those done with the same inputs and parameters."""
    cfg = load(config)
    rows = pipeline.run_stages(
        cfg, pipeline.select_stages(cfg, start, until), force=force, skip_preflight=skip_preflight
    )
    if as_json:
        emit_json({"run_dir": cfg.run_dir, "stages": rows})


class _StageCommand(TyperCommand):
    """A stage command whose --help says what the stage reads and writes, from its declaration (``reads``,
    ``writes``). Read when its own help is shown; the list of commands (`eaglekit --help`) gives the summary alone,
    because importing the stage modules takes seconds (torch among them)."""

    stage = ""
    summary = ""

    @property
    def help(self) -> str:
        declared = pipeline.stage_of(self.stage)
        return f"{self.summary} Reads {declared.reads}; writes {declared.writes}."

    @help.setter
    def help(self, value: str | None) -> None:
        pass  # the declaration says it

    @property
    def short_help(self) -> str:
        return self.summary

    @short_help.setter
    def short_help(self, value: str | None) -> None:
        pass  # the summary says it


def _stage_command(stage: str):
    def stage_cmd(
        config: Path = ConfigArg, force: bool = ForceOpt, skip_preflight: bool = SkipOpt, as_json: bool = JsonOpt
    ) -> None:
        cfg = load(config)
        rows = pipeline.run_stages(cfg, [stage], force=force, skip_preflight=skip_preflight)
        if as_json:
            emit_json(rows[0])

    stage_cmd.__name__ = f"{stage}_cmd"
    return stage_cmd


def generate_cmd(
    config: Path = ConfigArg,
    force: bool = ForceOpt,
    skip_preflight: bool = SkipOpt,
    as_json: bool = JsonOpt,
    retry_failed: bool = typer.Option(False, "--retry-failed", help="retry the samples in errors.jsonl"),
) -> None:
    cfg = load(config)
    rows = pipeline.run_stages(cfg, ["generate"], force=force, skip_preflight=skip_preflight, retry_failed=retry_failed)
    if as_json:
        emit_json(rows[0])


def export_cmd(
    config: Path = ConfigArg,
    force: bool = ForceOpt,
    skip_preflight: bool = SkipOpt,
    as_json: bool = JsonOpt,
    fmt: str = typer.Option("", "--format", help="eagle3 | speculators | all (default: export.formats)"),
) -> None:
    cfg = load(config)
    if fmt and fmt not in ("eagle3", "speculators", "all"):
        raise UsageError(f"--format {fmt}: unknown format", "use eagle3, speculators or all")
    formats: list[Any] = list(cfg.export.formats) if not fmt else (["eagle3", "speculators"] if fmt == "all" else [fmt])
    cfg.export.formats = formats  # part of the fingerprint: another --format is another export
    rows = pipeline.run_stages(cfg, ["export"], force=force, skip_preflight=skip_preflight, formats=formats)
    if as_json:
        emit_json(rows[0])


# Each stage's summary, the first sentence of its --help and its line in `eaglekit --help` (written here: the list
# of commands must not import the stage modules).
STAGE_SUMMARIES = {
    "generate": "Collect the target's own responses, reasoning included.",
    "prepare": "Render the responses with the target's chat template, tokenize, and mask the loss to the reply.",
    "vocab": "Choose the draft vocabulary (d2t/t2d) from the training tokens.",
    "extract": "Capture the target's hidden states at its aux layers to disk (offline mode; online and stream "
    "modes capture them inside train).",
    "train": "Train the drafter (EAGLE-3 with the training-time test, or a block drafter).",
    "evaluate": "Measure the drafter's acceptance length offline, by draft position and by context length.",
    "export": "Write the drafter in the forms vLLM and SGLang load, and print the serve commands.",
    "verify": "Serve the exported drafter in a real engine and compare its acceptance with the offline one.",
}
# Stages whose command takes flags of its own; every other stage gets the plain command (CONFIG, --force,
# --skip-preflight, --json). Registered in pipeline order.
OWN_COMMANDS = {"generate": generate_cmd, "export": export_cmd}
for _stage in pipeline.STAGE_ORDER:
    _fn = OWN_COMMANDS.get(_stage) or _stage_command(_stage)
    _summary = STAGE_SUMMARIES.get(_stage, f"Run the {_stage} stage.")
    _cls = type(f"{_stage.title()}Command", (_StageCommand,), {"stage": _stage, "summary": _summary})
    command(_stage, cls=_cls)(_fn)


# --------------------------------------------------------------------------------------- reporting


@command("status")
def status_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", show_default=False, help="the run directory (or a config file to compare it with)"
    ),
    wide: bool = typer.Option(False, "--wide", help="every figure, start times, durations, pre-flight"),
    as_json: bool = JsonOpt,
) -> None:
    """Where the run stands: per stage its state, figures, last pre-flight and warnings; then what to do next.
    A run directory is compared with the config file that last drove it."""
    compared = status.config_for(run_dir)
    cfg = compared.cfg
    _State.run_dir = cfg.run_dir
    rows = status.stage_rows(cfg)
    config = status.relative(cfg.source) if cfg.source else "CONFIG"
    if as_json:
        emit_json(
            {
                "run_dir": cfg.run_dir,
                "config": str(cfg.source),
                "compared": compared.note,
                "stages": rows,
                "next": status.next_steps(cfg, rows, config),
            }
        )
        return
    out = Console(highlight=False, width=None if sys.stdout.isatty() else (200 if wide else 80))
    status.render(out, compared, rows, wide=wide)


@command("watch")
def watch_cmd(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", show_default=False, help="the run whose drafter is served"),
    server: str = typer.Option(..., "--server", metavar="URL", help="the vLLM serving the drafter", show_default=False),
    window_s: float = typer.Option(60.0, "--window-s", help="seconds per window"),
    window_requests: int = typer.Option(0, "--window-requests", help="finished requests per window (instead of time)"),
    count: int = typer.Option(0, "--windows", help="stop after this many windows (0: until Ctrl-C)"),
    once: bool = typer.Option(False, "--once", help="one window, then stop (same as --windows 1)"),
    engine_log: Path | None = typer.Option(None, "--engine-log", help="the engine's log: the settings it started with"),
    temperature: float = typer.Option(0.0, "--temperature", help="the temperature the traffic samples at"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per window (JSON lines) on stdout"),
) -> None:
    """A served drafter's acceptance, window by window, against what the run's verify and evaluate measured at the
    served K: an alarm when served τ falls below the band their sample sizes allow, with the positions that fell
    and the likely cause (docs/watch.md). Exit 1 when a window fell below its band."""

    def emit(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    code = watch.run(
        run_dir,
        server,
        window_s,
        window_requests or None,
        1 if once else count or None,
        engine_log,
        temperature,
        as_json,
        emit=emit,
        say=lambda text: console.print(text, markup=False, highlight=False),
    )
    if code:
        raise typer.Exit(code)


@command("adapt")
def adapt_cmd(
    run_dir: Path = typer.Argument(
        ...,
        metavar="RUN_DIR",
        show_default=False,
        help="the run whose drafter is served (with --confirm: the adapt run)",
    ),
    traffic: Path | None = typer.Option(None, "--traffic", help="the gateway's log of the served traffic (JSONL)"),
    server: str | None = typer.Option(None, "--server", metavar="URL", help="the vLLM serving the drafter now"),
    out: Path | None = typer.Option(None, "--out", help="the adapt run directory (default: RUN_DIR-adapt-UTCSTAMP)"),
    samples: int = typer.Option(adapt.SAMPLES, "--samples", help="the newest conversations of the traffic read"),
    heldout: float = typer.Option(adapt.HELDOUT, "--heldout", help="the share of them held out for the comparison"),
    steps: int = typer.Option(adapt.STEPS, "--steps", help="finetuning steps"),
    lr: float = typer.Option(adapt.LR, "--lr", help="finetuning learning rate"),
    min_gain: float = typer.Option(adapt.MIN_GAIN, "--min-gain", help="the least relative τ gain promoted"),
    windows: int = typer.Option(adapt.CONFIRM_WINDOWS, "--windows", help="watch windows that confirm the swap"),
    window_requests: int = typer.Option(adapt.WINDOW_REQUESTS, "--window-requests", help="finished requests a window"),
    engine_log: Path | None = typer.Option(
        None, "--engine-log", help="the engine's log: which drafter folder it serves"
    ),
    confirm: str | None = typer.Option(None, "--confirm", metavar="URL", help="after a printed switch: watch URL"),
    previous: str | None = typer.Option(None, "--previous", metavar="URL", help="with --confirm: the previous server"),
) -> None:
    """Finetune the served drafter on its recent traffic, compare it offline with the served one on held-out
    traffic, and promote it only when better beyond noise: verify, swap (the engine's live draft weight update, or
    a second server), watch confirms, rollback when served τ falls (docs/adapt.md). Exit 1 when refused or rolled
    back."""
    say = functools.partial(console.print, markup=False, highlight=False)
    if confirm:
        switch = adapt.PrintedSwitch("", 0, previous or "the previous server", run_dir, say)
        outcome = adapt.confirm_or_roll_back(
            run_dir, confirm, switch, windows=windows, window_requests=window_requests, say=say
        )
        raise typer.Exit(outcome.code)
    if traffic is None or server is None:
        raise UsageError("adapt needs --traffic LOG and --server URL", "name the gateway's log and the serving vLLM")
    client = watch.connect(server)
    if not isinstance(client, watch.VllmClient):
        raise UsageError(
            f"{server} is SGLang: adapt swaps drafters in vLLM", "point --server at the vLLM serving the drafter"
        )
    k = client.num_speculative_tokens()
    if not k:
        raise UsageError(f"{server} drafts nothing (no speculative counters)", "point --server at the served drafter")
    served = watch.served_setup(client, engine_log, 0.0)
    folder = Path(served["model"]) if served.get("model") else run_dir / "export" / "eagle3"
    try:
        python = find_vllm_python(None)
    except UsageError:
        python = None
    adapt_dir = out or Path(f"{run_dir}-adapt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
    why_not = adapt.LiveDraftUpdate.unsupported(server, python)
    promotion: adapt.Promotion
    if why_not is None and python is not None:
        promotion = adapt.LiveDraftUpdate(server, python, folder)
    else:
        say(f"adapt: no live draft weight update: {why_not}; a second server instead")
        target = str(load_config(run_dir / "config.yaml").target.model)
        promotion = adapt.PrintedSwitch(target, k, server, adapt_dir, say)
    outcome = adapt.adapt(
        run_dir,
        traffic,
        adapt_dir,
        folder,
        k,
        promotion,
        samples=samples,
        steps=steps,
        lr=lr,
        heldout=heldout,
        min_gain=min_gain,
        windows=windows,
        window_requests=window_requests,
        engine=python is not None,
        say=say,
    )
    raise typer.Exit(outcome.code)


@command("preflight")
def preflight_cmd(
    config: Path = ConfigArg,
    stage: str | None = typer.Option(
        None,
        "--stage",
        metavar="STAGE",
        help=f"only this stage's checks, "
        f"exactly as `eaglekit STAGE` runs them (its upstream must have "
        f"finished): {STAGE_NAMES}",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Run the pre-flight checks alone (exit 1 on any fail).

    Without --stage, the whole pipeline is checked in order ahead of running it: a stage whose upstream has not
    run yet is not a failure, and the checks that need outputs still to be made say which stage produces them.
    """
    cfg = load(config)
    if stage and stage not in pipeline.STAGE_ORDER:
        raise UsageError(f"--stage {stage}: unknown stage", f"use one of: {', '.join(pipeline.STAGE_ORDER)}")
    t0 = time.monotonic()
    if stage:
        report = {stage: pipeline.run_preflight(pipeline.make_context(cfg, stage))}
    else:
        report = pipeline.preflight_pipeline(cfg)
    seconds = round(time.monotonic() - t0, 2)
    any_fail = any(preflight.failed(results) for results in report.values())
    if as_json:
        emit_json(
            {
                "ok": not any_fail,
                "seconds": seconds,
                "stages": {s: [r.to_dict() for r in results] for s, results in report.items()},
            }
        )
    else:
        for s, results in report.items():
            console.print(preflight.results_table(results, title=f"pre-flight of {s}"))
        counts = {k: sum(r.status == k for rs in report.values() for r in rs) for k in preflight.STATUSES}
        console.print(
            f"pre-flight: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, "
            f"{counts['skip']} skip in {seconds:.1f} s"
        )
    if any_fail:
        raise typer.Exit(1)


@command("plan")
def plan_cmd(
    config: Path = ConfigArg,
    samples: int | None = typer.Option(None, "--samples", min=1, help="plan for this many samples"),
    mean_tokens: float | None = typer.Option(None, "--mean-tokens", min=1, help="tokens per sample (prompt + reply)"),
    gen_tok_per_s: float | None = typer.Option(
        None, "--gen-tok-per-s", min=0.001, help="reply tokens per second over all servers"
    ),
    extract_tok_per_s: float | None = typer.Option(
        None, "--extract-tok-per-s", min=0.001, help="tokens per second of the target's forward (extract)"
    ),
    train_tok_per_s: float | None = typer.Option(
        None, "--train-tok-per-s", min=0.001, help="tokens per second of training"
    ),
    free: str | None = typer.Option(
        None,
        "--free-bytes",
        help="plan for this much free space (e.g. 2.8TB) instead of what the run directory's disk has",
    ),
    write_mb_per_s: float | None = typer.Option(
        None, "--write-mb-per-s", min=0.001, help="the disk's write rate instead of probing it"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Time, bytes, peak disk and write rate per stage, and whether the run fits (exit 1 when it does not).

    Figures measured in this run directory (a pilot with a small data.max_samples) are used unless a flag
    gives them; each figure says where it comes from.
    """
    from eaglekit.planning import parse_bytes, plan, render  # lazy: heavy (torch, through the stages a plan sizes)

    cfg = load(config)
    try:
        free_bytes = parse_bytes(free) if free is not None else None
    except ValueError as err:
        raise UsageError(f"--free-bytes: {err}", "e.g. --free-bytes 2.8TB") from None
    doc = plan(
        cfg,
        samples=samples,
        mean_tokens=mean_tokens,
        gen_tok_per_s=gen_tok_per_s,
        extract_tok_per_s=extract_tok_per_s,
        train_tok_per_s=train_tok_per_s,
        free_bytes=free_bytes,
        write_bytes_per_s=write_mb_per_s * 1e6 if write_mb_per_s else None,
    )
    if as_json:
        emit_json(doc)
    else:
        console.print(render(doc))
    if doc["verdict"] == "does not fit":
        raise typer.Exit(1)


@command("publish")
def publish_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", show_default=False, help="the run directory (or its config file)"
    ),
    repo: str = typer.Option(..., "--repo", metavar="ORG/NAME", help="the Hub repository to upload to"),
    form: str | None = typer.Option(None, "--form", help="the exported form to publish (default: the first)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="write the folder that would be uploaded; upload nothing"),
    private: bool = typer.Option(False, "--private", help="create the repository private"),
    unverified: bool = typer.Option(
        False, "--unverified", help="publish a drafter whose verify FAILed (the model card says so)"
    ),
    license_: str | None = typer.Option(
        None, "--license", help="the card's license (default: the one the target's own card declares)"
    ),
    token_env: str = typer.Option(
        "HF_TOKEN", "--token-env", metavar="VAR", help="the variable holding the Hub token (its name, never the token)"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Upload one exported form with a model card (front matter, τ tables, verify's figures, serve commands).

    Refuses a drafter that is not done, stale, damaged, non-finite, verify-FAILed or published for a local verifier.
    """
    from eaglekit import publish  # lazy: heavy (torch and huggingface_hub, to check and upload weights)

    compared = status.config_for(run_dir)
    cfg = compared.cfg
    _State.run_dir = cfg.run_dir
    config = status.relative(cfg.source) if cfg.source else str(run_dir)
    publication = publish.assemble(cfg, repo=repo, form=form, config=config, license_=license_, unverified=unverified)
    doc = publish.summary(publication)
    if not dry_run:
        doc["commit_url"] = publish.upload(publication, private=private, token_env=token_env)
    if as_json:
        emit_json(doc)
        return
    console.print(f"publish: {publication.form} with its model card in {publication.folder} ({doc['bytes']:,} bytes)")
    console.print(f"  verify: {publication.verified}")
    if dry_run:
        console.print(f"  dry run: nothing uploaded; `eaglekit publish {run_dir} --repo {repo}` uploads this folder")
    else:
        console.print(f"  uploaded: {doc['commit_url']}")


@command("serve-command")
def serve_command_cmd(config: Path = ConfigArg, as_json: bool = JsonOpt) -> None:
    """Print the command that starts a vLLM feature server for this config (extract.backend: vllm)."""
    from eaglekit.stages.extract import vllm_serve_command  # lazy: heavy (torch, through the extract stage)

    command = vllm_serve_command(load(config))
    if as_json:
        emit_json({"command": command})
    else:
        sys.stdout.write(command + "\n")


# ---------------------------------------------------------------------------------------- tiny demo


@command("demo")
def demo_cmd(
    run_dir: Path = typer.Option(Path("runs/demo"), "--run-dir", help="where the demo run lives"),
    force: bool = ForceOpt,
    as_json: bool = JsonOpt,
    offline: bool = typer.Option(False, "--offline", help="extract the features to disk, then train from them"),
) -> None:
    """The whole pipeline on the built-in tiny target, on CPU: writes RUN_DIR/config.yaml, runs every stage."""
    from eaglekit.demo import run_demo  # lazy: heavy (torch, and every stage the demo runs)

    _State.run_dir = str(run_dir)
    summary = run_demo(run_dir, force=force, offline=offline)
    if as_json:
        emit_json(summary)


@command("tiny-target")
def tiny_target_cmd(
    out_dir: Path | None = typer.Argument(
        None,
        metavar="[OUT_DIR]",
        help="folder to write the model into; left out, the cached one the demo and the tests use (built once)",
        show_default=False,
    ),
    seed: int = typer.Option(0, help="training seed (the cached target is seed 0)"),
    long: bool = typer.Option(
        False,
        "--long",
        help="the long-context variant: 32K positions, replies that check names against a tool log's far-back notes",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Write the built-in tiny target (a trained reasoning-style Llama) in Hugging Face format."""
    from eaglekit.tiny import (  # lazy: heavy (eaglekit.tiny imports transformers)
        build_long_target,
        build_tiny_target,
        ensure_long_target,
        ensure_tiny_target,
    )

    what = "long-context tiny target" if long else "tiny target"
    if out_dir is None and seed != 0:
        raise UsageError(f"--seed {seed}: the cached {what} is seed 0", "name an OUT_DIR to build another seed")
    build, ensure = (build_long_target, ensure_long_target) if long else (build_tiny_target, ensure_tiny_target)
    path = build(out_dir, seed=seed) if out_dir is not None else ensure()
    if as_json:
        emit_json({"path": str(path)})
    else:
        console.print(f"{what} written to {path}" if out_dir is not None else f"{what} ready in {path}")


# ------------------------------------------------------------------------------------------- errors

# typer ships its own copy of click in recent versions: take the classes from typer's own exceptions.
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def exact(text: str) -> str:
    """A remedy with the config the user passed in place of the CONFIG placeholder."""
    config = _State.config
    return re.sub(r"\bCONFIG\b", lambda _: shlex.quote(config), text) if config else text


def usage_line(err: Any, argv: list[str]) -> str:
    """A click usage error in one line: what is wrong, the usage, and where the help is."""
    ctx = getattr(err, "ctx", None)
    message = err.format_message().rstrip(".")
    if message == "Missing command":
        message = "no command given"
    if ctx is None:  # the option parser's errors carry no context: name the command from the arguments
        name = next((a for a in argv if a in app_command_names()), None)
        return f"error: {message} (`eaglekit {name + ' ' if name else ''}--help` for the usage)"
    usage = re.sub(r"[{}]", "", ctx.get_usage().replace("Usage: ", "").strip())  # typer braces required arguments
    hint = f"usage: {usage}"
    if ctx.parent is None:
        hint += f"; commands: {', '.join(app_command_names())}"
    return f"error: {message} ({hint}; `{ctx.command_path} --help` for more)"


def app_command_names() -> list[str]:
    return [c.name for c in app.registered_commands if c.name]


def report_interrupt(err: KeyboardInterrupt) -> int:
    note = (
        getattr(err, "eaglekit_note", None) or "interrupted: finished stages are kept; rerun the same command to resume"
    )
    console.print(f"[yellow]{escape(note)}[/]")
    return interrupt.exit_code(err)


def report_crash(err: BaseException) -> int:
    """An exception nothing foresaw outside a stage: a short message, the traceback in a log file."""
    log = failures.write_traceback(RunDir(_State.run_dir) if _State.run_dir else None, None, err)
    console.print(
        f"[bold red]error:[/] unexpected {type(err).__name__}: {escape(failures.first_line(err))}", highlight=False
    )
    console.print(
        f"the full traceback is in {log or '(no log file: it could not be written)'}; "
        "`eaglekit --debug ...` prints it here. If it is a bug in eaglekit, please report it with that file."
    )
    if _State.debug:
        traceback.print_exception(type(err), err, err.__traceback__)
    return 1


def main(argv: list[str] | None = None) -> None:
    interrupt.raise_on_sigterm()
    _State.config = _State.run_dir = None
    _State.debug = bool(os.environ.get("EAGLEKIT_DEBUG"))
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Without standalone mode click returns (rather than raises) the code of typer.Exit.
        rc = app(args=argv, standalone_mode=False, prog_name="eaglekit")
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except _Interrupted as wrapped:
        sys.exit(report_interrupt(wrapped.original))
    except KeyboardInterrupt as err:
        sys.exit(report_interrupt(err))
    except EaglekitError as err:
        console.print(f"[bold red]error:[/] {escape(exact(err.message))}", highlight=False)
        if err.remedy:
            console.print(f"[bold]what to do:[/] {escape(exact(err.remedy))}", highlight=False)
        original = getattr(err, "original", None)
        if _State.debug and original is not None:
            traceback.print_exception(type(original), original, original.__traceback__)
        sys.exit(err.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        console.print("aborted")
        sys.exit(130)
    except ClickException as err:
        console.print(usage_line(err, argv), markup=False, highlight=False)
        code = getattr(err, "exit_code", 2)
        sys.exit(2 if code in (1, 2) else code)
    except SystemExit:
        raise
    except Exception as err:
        named = failures.outside_stage(err)  # a full disk writing the ledger between stages: named, not a crash
        if named is None:
            sys.exit(report_crash(err))
        console.print(f"[bold red]error:[/] {escape(exact(named.message))}", highlight=False)
        console.print(f"[bold]what to do:[/] {escape(exact(named.remedy or ''))}", highlight=False)
        sys.exit(named.exit_code)


if __name__ == "__main__":
    main()

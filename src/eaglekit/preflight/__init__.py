"""Pre-flight: establish a stage's ground truth before it starts a long run.

A check is a small function ``check(ctx) -> CheckResult`` (or a list of them). Each stage declares the
checks it needs; the runner times them, turns an unexpected exception into a ``fail`` naming the check,
its input and the exception in one line (the traceback goes to RUN_DIR/logs), and the stage refuses to
start on any ``fail`` — printing a table that says what to do. Results go into the ledger with the stage run. ``eaglekit preflight CONFIG`` runs them alone.

The checks, one family per file (docs/preflight.md: "What each check family catches"):

    run_directory.py the run directory: its lock, the upstream stage, the output folder, the target folder
    files.py        model files: safetensors headers, sharded indexes, dense embedding/norm/lm_head; feature shards
    dataset.py      the prompts dataset: rows, shapes, bad rows, duplicates, prompts longer than the context
    disk.py         free bytes and inodes, the filesystem (network-backed?), a write-rate probe
    gpus.py         every GPU through NVML: memory, processes, ECC, uniformity; the target's placement
    processes.py    other processes using the run directory without its lock
    environment.py  software versions, devices vs what the config asks
    servers.py      generate's servers: reachable, the model served, context length, health, one real request
    capture.py      extract's capture self-check: captured states rebuild the target's own log-probabilities
    context.py      the context the drafter is served at vs the length of the documents it trains on
    feature_servers.py  the vLLM feature servers (extract's vllm backend, train's stream): reach, storage, a smoke
                    request with the capture self-check
    drafter.py      the trained drafter fits the target, and the evaluation prompts (evaluate, export, verify)
    trackers.py     the experiment trackers train.report_to names: installed, reachable, credentials present

Checks only one stage needs live in that stage's module; a stage lists the checks it runs in its ``checks(cfg)``.

A stage's checks see a context (``eaglekit.contract.StageContext``): ``cfg``, ``run``, ``stage``, ``dir``,
``stage_def`` (the stage's declaration) and ``estimate()`` (its estimate from its inputs on disk), ``upstream``
and its ``upstream_fingerprint``, and ``pending`` — the stages that will run before this one when the whole
pipeline is pre-flighted ahead of a first run; a check that needs their outputs says so with ``will_be_produced``
instead of failing.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from rich.markup import escape
from rich.table import Table

from eaglekit.contract import StageContext
from eaglekit.errors import EaglekitError

STATUSES = ("ok", "warn", "fail", "skip")


@dataclass
class CheckResult:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str = ""
    remedy: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ok(name: str, detail: str = "") -> CheckResult:
    return CheckResult(name, "ok", detail)


def warn(name: str, detail: str, remedy: str = "") -> CheckResult:
    return CheckResult(name, "warn", detail, remedy)


def fail(name: str, detail: str, remedy: str) -> CheckResult:
    return CheckResult(name, "fail", detail, remedy)


def skip(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "skip", detail)


Check = Callable[[StageContext], "CheckResult | list[CheckResult]"]


def will_be_produced(ctx: StageContext, name: str, stage: str) -> CheckResult | None:
    """A ``skip`` for a check that needs ``stage``'s outputs when that stage has yet to run in this pre-flight
    of the whole pipeline; None when the check should look (the outputs must then be there)."""
    if stage in ctx.pending:
        return skip(name, f"will be produced by `{stage}`")
    return None


def run_checks(ctx: StageContext, checks: Iterable[Check]) -> list[CheckResult]:
    results: list[CheckResult] = []
    for check in checks:
        t0 = time.monotonic()
        try:
            out = check(ctx)
        except EaglekitError as err:  # a problem the code foresaw and explains: a plain fail, no traceback
            out = fail(_check_name(check), err.message, err.remedy or "")
        except Exception as err:  # a check that crashes must not crash the pre-flight, nor show a traceback
            out = could_not_run(ctx, check, err)
        outs = out if isinstance(out, list) else [out]
        elapsed = (time.monotonic() - t0) / max(len(outs), 1)
        for r in outs:
            r.seconds = round(elapsed, 3)
        results.extend(outs)
    return results


def _check_name(check: Check) -> str:
    return getattr(check, "__name__", type(check).__name__)


def could_not_run(ctx: StageContext, check: Check, err: Exception) -> CheckResult:
    """The ``fail`` of a check that raised what it did not foresee: the check, its input and the exception in one
    line; the traceback goes to a log under the run directory, as the CLI keeps an unexpected error's."""
    name = _check_name(check)
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else "(no message)"
    source = ctx.cfg.source or "the run config"
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        log = str(ctx.run.write_log(f"preflight-{ctx.stage}-{name}-{time.strftime('%Y%m%d-%H%M%S')}.log", trace))
    except OSError as log_err:
        log = f"nowhere ({ctx.run.path / 'logs'}: {log_err.strerror or log_err})"
    return fail(
        name,
        f"check {name} could not run on {source} (stage {ctx.stage}): {type(err).__name__}: {first}",
        f"look at the input that check reads for a value out of the ordinary; if it is valid, it is a bug in "
        f"eaglekit: please report it with the traceback, which is in {log}",
    )


def failed(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == "fail"]


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def results_table(results: list[CheckResult], title: str = "pre-flight") -> Table:
    table = Table(title=title, show_lines=False)
    for col in ("check", "status", "detail", "what to do"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(escape(r.name), f"[{_STYLE[r.status]}]{r.status}[/]", escape(r.detail), escape(r.remedy))
    return table

"""Experiment trackers (``train.report_to``): TensorBoard, trackio, Weights & Biases and MLflow behind one interface.

Training hands each line of ``train/metrics.jsonl`` to ``Trackers.log_row`` as it writes it; evaluate and verify
reopen the same tracker runs (``report_results``) to add their τ tables and plots. Which tracker run a run directory
logs to is kept in ``train/trackers.json`` with, per tracker, how many of metrics.jsonl's lines it holds: a resumed
run continues the same tracker runs, replays what a tracker lost when the run was killed and skips what it already
holds (no step twice, none missing). A tracker that fails (its server gone, a quota) is warned about once and
dropped for the rest of the command: metrics.jsonl keeps every step, and training never stops for a tracker.

Each tracker's library is an optional extra (``pip install eaglekit[trackio]`` …), imported when it is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from eaglekit import atomic
from eaglekit.resolved import ResolvedRun
from eaglekit.training import distributed as dist

TRACKER_NAMES = ("tensorboard", "trackio", "wandb", "mlflow")
IDENTITIES = "trackers.json"  # in the train stage's folder
PROJECT = "eaglekit"  # the project/experiment name where the tracker's own variable does not set one

# the module each tracker needs, and the extra that installs it
MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


def installed(name: str) -> bool:
    return importlib.util.find_spec(MODULES[name]) is not None


def configured(name: str, env: dict[str, str] | None = None) -> bool:
    """Whether the environment says where ``name`` logs: the trackers a config that leaves report_to unset uses
    (TensorBoard needs nothing: it writes beside metrics.jsonl)."""
    env = dict(os.environ) if env is None else env
    if name == "tensorboard":
        return True
    if name == "wandb":
        return bool(env.get("WANDB_API_KEY")) or env.get("WANDB_MODE") in ("offline", "disabled")
    if name == "mlflow":
        return bool(env.get("MLFLOW_TRACKING_URI"))
    return any(env.get(v) for v in ("TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_PROJECT"))


def chosen(report_to: Sequence[str] | None) -> list[str]:
    """The trackers a run logs to: report_to as written, else each one installed and configured."""
    if report_to is not None:
        return list(dict.fromkeys(report_to))
    return [name for name in TRACKER_NAMES if installed(name) and configured(name)]


def project_name(name: str) -> str:
    variable = {"trackio": "TRACKIO_PROJECT", "wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}.get(name)
    return (os.environ.get(variable) if variable else None) or PROJECT


def scalars(row: dict) -> dict[str, float]:
    """A metrics.jsonl line as the trackers' scalars: ``train/loss``, ``train/acc_0`` …, ``eval/tau`` (the step is
    the row's; ``kind`` names the group). One definition: every tracker logs these names."""
    kind = row["kind"]
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("kind", "step"):
            continue
        if isinstance(value, list):
            for k, v in enumerate(value):
                if isinstance(v, (int, float)):
                    out[f"{kind}/{key.removesuffix('_k')}_{k}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{kind}/{key}"] = float(value)
    return out


def flat(params: dict, prefix: str = "") -> dict[str, Any]:
    """Nested parameters as dotted keys (MLflow's and TensorBoard's parameters are flat)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flat(value, f"{name}.")
        else:
            out[name] = value
    return out


class Backend:
    """One tracker run. Every method may raise: ``Trackers`` catches, warns once and drops the tracker."""

    name = ""

    def identity(self) -> dict:
        """What reopens this tracker run (kept in train/trackers.json)."""
        return {}

    def held_rows(self, handed: int, kept: list[dict], closed: bool) -> int:
        """How many of metrics.jsonl's lines the tracker holds, of the ``handed`` it was given before the run stopped
        (``closed``: the tracker was closed then; a kill may have cost one that writes in the background its last
        lines); ``kept``: the lines of the steps the resumed run restored (those past them are written again)."""
        return handed

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def params(self, params: dict) -> None:
        raise NotImplementedError

    def table(self, name: str, rows: list[dict], step: int) -> None:
        raise NotImplementedError

    def image(self, name: str, path: Path, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def open_backend(name: str, folder: Path, run_name: str, identity: dict | None, resume_step: int | None) -> Backend:
    from eaglekit.training.trackers import backends  # lazy: cycle (backends subclass Backend, defined here)

    opener: Callable[..., Backend] = {
        "tensorboard": backends.TensorBoard,
        "trackio": backends.Trackio,
        "wandb": backends.Wandb,
        "mlflow": backends.Mlflow,
    }[name]
    return opener(folder, run_name, identity or {}, resume_step)


class Trackers:
    """The trackers one command logs to, each guarded: the first error of a tracker is one warning, then the tracker
    is dropped (``failed`` keeps its name and error); the others and the run go on."""

    def __init__(self, folder: Path, names: Sequence[str], run_name: str, warn: Callable[[str], None]):
        self.folder, self.run_name, self.warn = folder, run_name, warn
        self.backends: dict[str, Backend] = {}
        self.handed: dict[str, int] = {}  # metrics.jsonl lines each tracker was given
        self.failed: dict[str, str] = {}
        self.names = list(names)

    # ---------------------------------------------------------------------------------------------- opening

    @classmethod
    def for_training(cls, folder: Path, names: Sequence[str], run_name: str, params: dict,
                     kept_rows: list[dict] | None, resume_step: int | None,
                     warn: Callable[[str], None]) -> Trackers:  # fmt: skip
        """The trackers a training run logs to. ``kept_rows``/``resume_step``: a resumed run's metrics.jsonl lines
        (those of the restored checkpoint's steps) and its step; a tracker that holds fewer of them gets the rest
        again, one that holds more skips the lines training writes again."""
        t = cls(folder, names if dist.is_main() else [], run_name, warn)
        stored = t.stored() if resume_step is not None else {}
        if resume_step is None and dist.is_main():  # a fresh run: new tracker runs, none of the last run's reopened
            (folder / IDENTITIES).unlink(missing_ok=True)
        # the tracker run's name: the run directory's and when it started (a project holds many run directories)
        t.run_name = str(stored.get("_run_name") or f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_name = t.run_name
        rows = kept_rows or []
        for name in t.names:
            before = stored.get(name)
            opened = t.guarded(name, open_backend, name, folder, run_name, before, resume_step)
            if opened is None:
                continue
            t.backends[name] = opened
            if before is None:
                t.guarded(name, opened.params, params)
                held = 0
            else:
                held = t.guarded(name, opened.held_rows, int(before.get("rows", 0)), rows, bool(before.get("closed")))
            t.handed[name] = held or 0
            for index in range(held, len(rows)):
                t.log_row(index, rows[index], only=name)
        t.save()
        return t

    @classmethod
    def reopen(cls, folder: Path, warn: Callable[[str], None]) -> Trackers | None:
        """The tracker runs training logged to, reopened for evaluate's and verify's results; None when training
        logged to none (or ran before trackers were kept)."""
        if not dist.is_main():
            return None
        stored = cls(folder, [], "", warn).stored()
        if not stored:
            return None
        t = cls(folder, list(stored), str(stored.get("_run_name", folder.parent.name)), warn)
        t.names = [name for name in stored if name in TRACKER_NAMES]
        for name in t.names:
            identity = stored[name]
            opened = t.guarded(name, open_backend, name, folder, t.run_name, identity, -1)
            if opened is not None:
                t.backends[name] = opened
                t.handed[name] = int(identity.get("rows", 0))
        return t

    def stored(self) -> dict:
        path = self.folder / IDENTITIES
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, closed: bool = False) -> None:
        if not self.backends:
            return
        # a tracker that failed in this command keeps what reopens its run, for the next command
        data: dict[str, Any] = {**self.stored(), "_run_name": self.run_name}
        for name, backend in self.backends.items():
            data[name] = {**backend.identity(), "rows": self.handed.get(name, 0), "closed": closed}
        atomic.write_json(self.folder / IDENTITIES, data)

    # ---------------------------------------------------------------------------------------------- logging

    def guarded(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` for tracker ``name``; None once it has failed."""
        if name in self.failed:
            return None
        try:
            return call(*args)
        except Exception as err:  # a tracker never stops the run: one warning, then it is dropped
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            self.failed[name] = f"{type(err).__name__}: {first}"
            backend = self.backends.pop(name, None)
            self.warn(
                f"tracker {name} failed ({self.failed[name]}): it logs nothing more in this command; every step "
                f"is still in train/metrics.jsonl, and rerunning the command continues the same tracker run"
            )
            if backend is not None:
                with contextlib.suppress(Exception):  # closing a broken tracker is best effort: it was warned about
                    backend.close()
            return None

    def log_row(self, index: int, row: dict, only: str | None = None) -> None:
        """metrics.jsonl's line number ``index`` to every tracker that does not hold it yet."""
        values = scalars(row)
        for name in [only] if only else list(self.backends):
            backend = self.backends.get(name)
            if backend is None or index < self.handed.get(name, 0):
                continue
            self.guarded(name, backend.log, row["step"], values)
            if name in self.backends:  # it took the line (a failure drops it)
                self.handed[name] = index + 1
        if only is None:
            self.save()

    def table(self, name: str, rows: list[dict], step: int) -> None:
        if rows:
            for tracker, backend in list(self.backends.items()):
                self.guarded(tracker, backend.table, name, rows, step)

    def image(self, name: str, path: Path, step: int) -> None:
        if path.exists():
            for tracker, backend in list(self.backends.items()):
                self.guarded(tracker, backend.image, name, path, step)

    def close(self) -> None:
        for name, backend in list(self.backends.items()):
            self.guarded(name, backend.close)
        self.save(closed=True)
        self.backends.clear()


def run_params(cfg: Any) -> dict:
    """The run's config and its resolved plan (``ResolvedRun``: the family, aux layers, window, served context), as
    the trackers' parameters."""
    run = ResolvedRun(cfg)
    plan: dict[str, Any] = {"family": run.family}
    reads: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("aux_layers", lambda: run.aux_layers),
        ("window", lambda: run.window),
        ("served_context", lambda: run.served),
        ("max_position_embeddings", lambda: run.max_position_embeddings),
    )
    for key, read in reads:
        try:
            value = read()
        except Exception as err:  # a figure the run cannot resolve yet is named, not fatal to logging
            value = f"unresolved: {type(err).__name__}"
        plan[key] = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
    return {"config": cfg.model_dump(mode="json"), "resolved": plan}


def report_results(train_dir: Path, tables: dict[str, list[dict]], images: dict[str, Path],
                   warn: Callable[[str], None]) -> list[str]:  # fmt: skip
    """evaluate's or verify's tables and plots into the tracker runs training logged to (none: nothing), at the last
    step training logged. Returns the trackers that took them."""
    trackers = Trackers.reopen(train_dir, warn)
    if trackers is None:
        return []
    step = last_step(train_dir / "metrics.jsonl")
    for name, rows in tables.items():
        trackers.table(name, rows, step)
    for name, path in images.items():
        trackers.image(name, path, step)
    took = list(trackers.backends)
    trackers.close()
    return took


def evaluate_tables(report: dict) -> dict[str, list[dict]]:
    """evaluate/report.json's τ tables: by method, K and temperature; by context group; by suite."""
    results = report.get("results") or []
    by_k = [
        {key: r.get(key) for key in ("method", "k", "temperature", "tau", "tau_vllm", "speedup", "tokens_per_second")}
        | {f"acceptance_{i}": a for i, a in enumerate(r.get("acceptance_by_position") or [])}
        for r in results
    ]
    by_context = [
        {"method": r["method"], "k": r["k"], "temperature": r["temperature"]}
        | {group: figures.get("tau") for group, figures in r["tau_by_context"].items()}
        for r in results
        if len(r.get("tau_by_context") or {}) > 1
    ]
    suites = (report.get("suites") or {}).get("rows") or []
    return {"evaluate/tau": by_k, "evaluate/tau_by_context": by_context, "evaluate/tau_by_suite": suites}


def verify_tables(report: dict) -> dict[str, list[dict]]:
    """verify/report.json's served-vs-offline table: τ per form and K, and acceptance per draft position."""
    runs = report.get("runs") or []
    served = [
        {"form": r["form"], "k": r["k"], "engine": r["engine"], "tau_served": r["tau"]["served"],
         "tau_offline": r["tau"]["offline"], "relative_difference": r["tau"]["relative_difference"],
         "drafts_per_pass": r.get("drafts_per_pass"), "passed": r["passed"]}
        for r in runs
    ]  # fmt: skip
    positions = [{"form": r["form"], "k": r["k"], **p} for r in runs for p in r.get("positions") or []]
    return {"verify/served_vs_offline": served, "verify/positions": positions}


def last_step(metrics_path: Path) -> int:
    """The last step metrics.jsonl holds (0: none): where evaluate's and verify's tables are logged."""
    step = 0
    try:
        for line in metrics_path.read_text().splitlines():
            try:
                step = max(step, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    except OSError:
        return 0
    return step

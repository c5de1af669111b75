"""The stage contract: what a stage declares, and the context it runs and is checked in.

A stage is one module in ``eaglekit.stages`` that ends with ``STAGE = Stage(...)``, and one line in
``pipeline.STAGE_ORDER``. Everything else derives from the declaration: the run order and which stages a config
runs (``runs_for``), the upstream a stage reads once skipped stages are stepped over, the CLI's per-stage commands
and their --help (``reads``/``writes``), `status`'s live counts and data flags, the pre-flight disk, inode and
write-rate checks and `eaglekit plan` (both call ``estimate``).

This module sits in layer 1 (docs/architecture.md), beside the run's resolution it carries
(``eaglekit.resolved``): pre-flight checks type their ``ctx`` with it without importing the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from eaglekit import rundir
from eaglekit.config import RunConfig
from eaglekit.progress import console
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir

T = TypeVar("T")


@dataclass
class Sizes:
    """The figures `eaglekit plan` projects a run from (see planning.gather_inputs: each says where it comes
    from). None where unknown; ``dtype`` is the extract dtype being planned (an alternative may differ from the
    config's)."""

    samples: float | None
    mean_tokens: float | None
    output_tokens: float | None
    hidden_size: float | None
    gen_tok_per_s: float | None
    extract_tok_per_s: float | None
    train_tok_per_s: float | None
    write_bytes_per_s: float | None
    dtype: str
    # this stage's last finished `end` event in the ledger ({} when none): a pilot's measured time
    ledger_end: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> float | None:
        known = self.samples is not None and self.mean_tokens is not None
        return self.samples * self.mean_tokens if known else None  # type: ignore[operator]


@dataclass
class Estimate:
    """What a stage will write and take. Every field is None where the stage cannot know it yet."""

    bytes: float | None = None
    per_sample_bytes: float | None = None  # the part of ``bytes`` that scales with the number of samples
    files: int | None = None  # inodes it creates (pre-flight's inode check)
    seconds: float | None = None
    write_rate: tuple[float, str] | None = None  # bytes/s it writes at and why (pre-flight's write probe)
    need_write_rate: float | None = None  # the same figure in a plan (bytes/s at the planned rate)
    how: list[str] = field(default_factory=list)  # the arithmetic, one line per figure, for `eaglekit plan`


def measured_time(est: Estimate, sizes: Sizes, unit: str | None) -> None:
    """Time from a pilot of this run (``sizes.ledger_end``): scaled by ``unit`` (a count in the ledger, e.g.
    samples) to ``sizes.samples``, or as measured when the stage's time does not scale."""
    seconds = sizes.ledger_end.get("seconds")
    if seconds is None:
        return
    n = sizes.samples
    done = (sizes.ledger_end.get("counts") or {}).get(unit) if unit else None
    if unit and done and n:
        est.seconds = seconds / done * n
        est.how.append(f"time: measured {seconds:.0f} s for {done:,.0f} {unit}, scaled to {n:,.0f}")
    else:
        est.seconds = seconds
        est.how.append(f"time: as measured in this run ({seconds:.0f} s)")


@dataclass(frozen=True)
class StaleCause:
    """Why a finished stage no longer matches the config: the first stage (in run order) whose own inputs or
    parameters changed since it ran (``changed_in``) and what changed ("input: old → new"); the first stage
    finished with other inputs (``stage``, usually the same one), the command that reruns from it, and the
    finished stages before it, which stay valid."""

    stage: str
    changed_in: str
    changes: list[str]
    command: str
    kept: list[str]


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
    # Signs of a degenerate run (see warn); kept in the ledger's `end` event and shown by `eaglekit status`.
    warnings: list[str] = field(default_factory=list)
    # What the pre-flight checks need from the pipeline, handed over so that they never import it.
    declared: Stage | None = None
    stages: tuple[str, ...] = ()  # the stages this config runs, in order
    upstream: str | None = None
    upstream_fingerprint: str | None = None
    # Stages that will run before this one: set only when the whole pipeline is pre-flighted ahead of a run,
    # so a check that needs their outputs says "will be produced by ..." instead of failing.
    pending: tuple[str, ...] = ()
    # The pipeline's answers to "which command finishes stage S" and "what changed since this stage last ran".
    reach: Callable[[str], str] = lambda stage: f"eaglekit run CONFIG --until {stage}"
    changes: Callable[[], list[str] | None] = lambda: None
    stale_cause: Callable[[str], StaleCause | None] = lambda stage: None
    is_worker_rank: bool = False
    # The run resolved for this stage (pipeline.make_context); made from cfg when a context is made without it.
    resolution: ResolvedRun | None = field(default=None, repr=False)
    _estimate: Estimate | None = field(default=None, repr=False)
    _made_once: dict[Callable[..., Any], Any] = field(default_factory=dict, repr=False)

    @property
    def stage_def(self) -> Stage:
        if self.declared is None:
            raise RuntimeError(f"{self.stage}: context made without its stage declaration (use pipeline.make_context)")
        return self.declared

    @property
    def resolved(self) -> ResolvedRun:
        """The run resolved (the window auto chose and why, the served context, the feature servers' settings...):
        what this stage's fingerprint was taken over, and what its checks and its run read."""
        if self.resolution is None:
            self.resolution = ResolvedRun(self.cfg)
        return self.resolution

    @property
    def dir(self) -> Path:
        return self.run.stage_dir(self.stage)

    def estimate(self) -> Estimate:
        """The stage's estimate from its inputs on disk, made once per context: the disk, inode and write-rate
        checks share it (extract's sizes every planned shard)."""
        if self._estimate is None:
            self._estimate = self.stage_def.estimate(self, None)
        return self._estimate

    def once(self, make: Callable[[StageContext], T]) -> T:
        """``make(self)``, made once per context: what several of its checks compare, such as the prompts' token
        counts (preflight/dataset.prompt_tokens), so a pre-flight run computes it once."""
        if make not in self._made_once:
            self._made_once[make] = make(self)
        return cast(T, self._made_once[make])

    @property
    def resuming(self) -> bool:
        """The folder holds this fingerprint's partial outputs: continue them (never discarded, --force or not)."""
        marker = self.run.read_marker(self.stage)
        return bool(marker and marker.get("fingerprint") == self.fingerprint)

    def continues(self, state: str) -> str | None:
        """What the stage keeps of the outputs of other parameters in its folder, and what it will do, when it goes
        on from them rather than replacing them (its ``continues`` hook: generate, when only the prompts changed);
        None when they are replaced."""
        if state not in (rundir.OTHER_DONE, rundir.OTHER_PARTIAL, rundir.FAILED_LEFTOVERS):
            return None
        return self.once(self.stage_def.continues)  # pre-flight and the run ask it several times

    def refusal(self, state: str) -> tuple[str, str] | None:
        """(what the folder holds, what to do) when replacing it needs --force; None when the stage may write there.

        --force replaces only what needs it: finished or partial outputs of other parameters, or files eaglekit
        did not write. It never reruns a stage that is done with the same fingerprint, and what a *failed* attempt
        left behind is replaced without it. Outputs the stage goes on from (``continues``) are not replaced.
        """
        if self.force or state in (rundir.EMPTY, rundir.OWN, rundir.FAILED_LEFTOVERS) or self.continues(state):
            return None
        marker = self.run.read_marker(self.stage) or {}
        again = (
            f"add --force to replace them (`eaglekit run CONFIG --from {self.stage} --force` reruns {self.stage} and "
            f"the stages after it; finished stages before it are kept), or set another run_dir to keep them"
        )
        if state == rundir.FOREIGN:
            return (
                f"{self.dir} holds files that no eaglekit stage run wrote (no {rundir.MARKER})",
                f"move them away, or {again}",
            )
        changes = self.changes()
        what = "the finished outputs" if state == rundir.OTHER_DONE else "the partial outputs of an interrupted run"
        return (
            f"{self.dir} holds {what} of other inputs or parameters (written {marker.get('created', '?')}"
            f"{'; changed since: ' + '; '.join(changes) if changes else ''})",
            again,
        )

    def command_to_reach(self, stage: str) -> str:
        """The one command that finishes every stage up to ``stage`` (for the remedies of the checks)."""
        return self.reach(stage)

    def warn(self, message: str) -> None:
        """Say that the run is degenerate in a way the user must hear about (too few samples, a drafter no better
        than n-gram, ...): printed now, recorded in the ledger, repeated by `eaglekit status` and the export."""
        self.warnings.append(message)
        if not self.is_worker_rank:
            console.print(f"[yellow]{self.stage}: warning: {message}[/]")


def always(cfg: RunConfig) -> bool:
    return True


def no_estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    return Estimate()


def nothing_kept(ctx: StageContext) -> str | None:
    return None


def never_damaged(ctx: StageContext) -> str | None:
    return None


def continues_nothing(ctx: StageContext) -> str | None:
    return None


def no_live_counts(stage_dir: Path) -> dict[str, Any] | None:
    return None  # `status` shows what the ledger recorded


def no_data_flags(counts: dict[str, Any]) -> list[str]:
    return []


@dataclass
class Stage:
    """One stage's declaration. The required fields are what every stage has; the hooks default to "nothing"."""

    name: str
    upstream: str | None  # the stage whose outputs it reads (before skipped stages are stepped over)
    reads: str  # in words, for its command's --help
    writes: str  # its outputs under the run directory, for --help
    # What its outputs depend on, as resolved values under names of the stage's own (the window as a number, not
    # "auto"): its fingerprint hashes them, so a key renamed or a rule reworded leaves a finished run done.
    params: Callable[[ResolvedRun], dict]
    checks: Callable[[RunConfig], list]  # its own pre-flight checks (the pipeline adds the generic ones)
    run: Callable[[StageContext], dict]  # does the work; returns counts for the ledger and `status`
    runs_for: Callable[[RunConfig], bool] = always  # False: this config skips it (extract online, verify unset)
    # What it will write and take. sizes=None: from its inputs on disk (pre-flight's disk, inode and write-rate
    # checks, the disk-full message); sizes given: from the plan's figures (`eaglekit plan`).
    estimate: Callable[[StageContext, Sizes | None], Estimate] = no_estimate
    kept: Callable[[StageContext], str | None] = nothing_kept  # what of a stopped run is safely on disk
    damaged: Callable[[StageContext], str | None] = never_damaged  # what a finished run's outputs miss (repair)
    # What it keeps of the outputs of other parameters in its folder and goes on from, with or without --force,
    # in words ("generate 6 new of 406; 400 kept"); None: they are replaced, only with --force.
    continues: Callable[[StageContext], str | None] = continues_nothing
    live_counts: Callable[[Path], dict[str, Any] | None] = no_live_counts  # counts `status` shows while it runs
    data_flags: Callable[[dict[str, Any]], list[str]] = no_data_flags  # bad data its recorded counts show

"""The traffic log (``data.traffic``): readable, and how many of its lines make samples of the run's target.

The whole log is read as generate will read it (the model check, the served-template check, the selection), once
per run: generate's run takes the same reading (``traffic_read``).
"""

from __future__ import annotations

from eaglekit.contract import StageContext
from eaglekit.data.traffic import TrafficRead, run_traffic
from eaglekit.errors import EaglekitError
from eaglekit.preflight import CheckResult, fail, ok, warn

REJECT_WARN_SHARE = 0.10  # rejects past this share of the log's lines are worth a warning


def traffic_read(ctx: StageContext) -> TrafficRead:
    """The run's traffic as read once for this context (its check and generate's run share it)."""
    return ctx.once(_read)


def _read(ctx: StageContext) -> TrafficRead:
    return run_traffic(ctx.cfg)


def traffic(ctx: StageContext) -> CheckResult:
    """``data.traffic.path`` exists and some of its lines are the run's target's whole replies."""
    name = "traffic"
    try:
        read = traffic_read(ctx)
        read.require_usable()
    except EaglekitError as err:
        return fail(name, err.message, err.remedy or "fix data.traffic")
    if len(read.rejects) > REJECT_WARN_SHARE * read.lines:
        return warn(
            name,
            read.summary(),
            "the rejected lines are left out (each named above by file:line and why); fix the log or the config "
            "where the reason says so",
        )
    return ok(name, read.summary())

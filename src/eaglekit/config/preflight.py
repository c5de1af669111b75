"""``preflight``: the checks run before a stage starts."""

from __future__ import annotations

from pydantic import Field

from eaglekit.config.base import Section


class PreflightConfig(Section):
    disk_probe_mb: float = Field(
        64,
        ge=0,
        description="MB written (incompressible, fsync'd) to measure the run directory's write rate; 0 skips the probe",
    )
    disk_probe_seconds: float = Field(2.0, gt=0, description="the write probe stops after this many seconds of writing")

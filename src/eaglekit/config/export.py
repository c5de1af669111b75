"""``export``: the forms the trained drafter is written in."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eaglekit.config.base import Section

ExportForm = Literal["eagle3", "speculators"]


def _both_forms() -> list[ExportForm]:
    return ["eagle3", "speculators"]


class ExportConfig(Section):
    formats: list[ExportForm] = Field(default_factory=_both_forms)
    verifier: str | None = Field(None, description="hub id of the target, required by vLLM's speculators form")
    num_speculative_tokens: int = Field(3, ge=1)
    include_embeddings: bool = True

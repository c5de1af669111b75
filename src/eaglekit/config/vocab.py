"""``vocab``: the drafter's vocabulary, the target's most used tokens."""

from __future__ import annotations

from pydantic import Field

from eaglekit.config.base import Section


class VocabConfig(Section):
    draft_vocab_size: int = Field(32000, ge=1)

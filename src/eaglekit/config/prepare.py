"""``prepare``: the replies tokenized into training rows."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eaglekit.config.base import Section


class PrepareConfig(Section):
    max_length: int = Field(2048, ge=8)
    overlong: Literal["drop", "truncate"] = "drop"
    keep_length_stopped: bool = Field(
        False,
        description="keep responses cut by max_tokens (finish_reason=length); their end-of-turn was never generated",
    )

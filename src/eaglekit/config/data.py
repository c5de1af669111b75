"""``data``: the prompts the run trains on."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eaglekit.config.base import Section
from eaglekit.config.paths import PATH


class DataConfig(Section):
    prompts: Annotated[str, PATH] = Field(
        min_length=1, description="JSONL (ShareGPT/OpenAI messages), Parquet, or a datasets saved folder"
    )
    max_samples: int | None = Field(None, ge=1)
    on_bad_row: Literal["fail", "skip"] = "fail"
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of samples held out for evaluation")

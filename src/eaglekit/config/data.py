"""``data``: the prompts the run trains on, or the served traffic it trains on instead (``data.traffic``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, model_validator

from eaglekit.config.base import Section, Seed
from eaglekit.config.paths import PATH


class TrafficConfig(Section):
    """Served conversations as a gateway logged them: the target's own replies, so generate asks no server."""

    path: Annotated[str, PATH] = Field(
        min_length=1,
        description="a JSONL gateway log (one chat-completions exchange a line: request and response bodies, or "
        "{messages: [...]} ending with the assistant's reply), or a folder of such *.jsonl files read in name order",
    )
    model: str | None = Field(
        None,
        description="the `model` the logged responses carry; default: generate.model, else target.model; "
        "another model's replies are rejected",
    )
    since: datetime | None = Field(
        None,
        description="only conversations created at or after this time (the response's `created`; UTC unless a zone is given)",
    )
    newest: int | None = Field(None, ge=1, description="keep the newest N usable conversations (recent traffic)")
    max_samples: int | None = Field(
        None, ge=1, description="a seeded sample of N conversations (stable when lines are appended to the log)"
    )
    seed: Seed = 0


class DataConfig(Section):
    prompts: Annotated[str | None, PATH] = Field(
        None,
        min_length=1,
        description="JSONL (ShareGPT/OpenAI messages), Parquet, or a datasets saved folder; set this or data.traffic",
    )
    traffic: TrafficConfig | None = Field(
        None,
        description="served conversations from a gateway log instead of prompts: no generate run (docs/traffic.md)",
    )
    max_samples: int | None = Field(None, ge=1, description="data.prompts: the first N prompts")
    on_bad_row: Literal["fail", "skip"] = "fail"
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of samples held out for evaluation")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.prompts is None) == (self.traffic is None):
            raise ValueError(
                "set one of data.prompts (prompts the target answers in generate) or data.traffic (a gateway log of "
                "its served replies)" + (", not both" if self.prompts is not None else "")
            )
        return self

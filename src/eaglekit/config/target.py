"""``target``: the model the drafter is trained for."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eaglekit.config.base import DtypeAlias, NonNegativeInt, Section
from eaglekit.config.paths import PATH_OR_HUB_ID, TEMPLATE_OR_PATH


class TargetConfig(Section):
    model: Annotated[str, PATH_OR_HUB_ID] = Field(
        min_length=1, description="Hugging Face folder or hub id of the target model"
    )
    chat_template: Annotated[str | None, TEMPLATE_OR_PATH] = Field(
        None, description="Jinja template or path to one, overriding the tokenizer's"
    )
    trust_remote_code: bool = False
    aux_layers: list[NonNegativeInt] | None = Field(
        None, description="HF hidden_states indices; default [2, N//2, N-3]"
    )
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], DtypeAlias] = "auto"
    device_map: str | None = Field(None, description="e.g. 'auto' to shard a large target over the GPUs")

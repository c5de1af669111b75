"""``evaluate``: the drafter's acceptance measured offline, on the held-out prompts and benchmark suites."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from eaglekit.config.base import NonNegativeFloat, PositiveInt, Section, Seed
from eaglekit.config.paths import PATH


class SuiteConfig(Section):
    """A named benchmark suite (eaglekit.data.suites) measured beside the run's own prompts."""

    # checked by eaglekit.data.suites when loaded (config, the lowest layer, does not import it)
    name: str = Field(description="mt_bench, gsm8k, humaneval, math500, alpaca or longbench_v2")
    num_samples: int | None = Field(None, ge=1, description="prompts taken from the start; default: the stage's")
    path: Annotated[str | None, PATH] = Field(
        None, description="local copy in the hub's layout (JSONL/Parquet/saved folder)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=64, description="cut the middle of a longer user turn to fit (LongBench's truncation)"
    )


def bare_suite_names(value: Any) -> Any:
    # `suites: [gsm8k, mt_bench]` is the common case: a bare name is a suite with the defaults
    return [{"name": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value


class EvaluateConfig(Section):
    prompts: Annotated[str | None, PATH] = Field(None, description="default: the held-out split of this run's data")
    num_samples: int = Field(8, ge=1, description="prompts decoded per method, K and temperature")
    num_speculative_tokens: list[PositiveInt] = Field(default_factory=lambda: [1, 3, 5, 7], min_length=1)
    temperatures: list[NonNegativeFloat] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    max_new_tokens: int = Field(128, ge=1)
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    seed: Seed = 0
    checkpoint: Annotated[str | None, PATH] = Field(None, description="drafter to evaluate; default: this run's best")
    suites: list[SuiteConfig] = Field(
        default_factory=list, description="benchmark suites measured too, e.g. [mt_bench, gsm8k]; one table each"
    )
    reasoning: Literal["on", "off", "both"] | None = Field(
        None,
        description="the chat template's thinking switch (enable_thinking) as served; both measures each; "
        "default: the template's own default",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="more chat template arguments, as vLLM's chat_template_kwargs"
    )
    context_lengths: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        description="the context lengths (tokens) the drafter will be served at; pre-flight warns when they lie far "
        "beyond the training documents (default: the target's max_position_embeddings, vLLM's default max_model_len)",
    )

    @field_validator("suites", mode="before")
    @classmethod
    def _bare_suite_names(cls, value: Any) -> Any:
        return bare_suite_names(value)

    @field_validator("reasoning", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML reads an unquoted on/off as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

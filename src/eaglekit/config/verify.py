"""``verify``: the exported drafter served in vLLM or SGLang and held to its offline figures."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from eaglekit.config.base import PositiveInt, Section
from eaglekit.config.evaluate import SuiteConfig, bare_suite_names
from eaglekit.config.paths import PATH
from eaglekit.errors import UsageError


class VerifyConfig(Section):
    """The exported drafter measured in the serving engine (run only when ``engine`` or ``server`` is set)."""

    engine: Literal["vllm"] | None = Field(
        None, description="start this engine with the target and each exported form, on a free loopback port"
    )
    server: str | None = Field(
        None, description="or: base URL of a vLLM or SGLang server you started with the command export printed"
    )
    python: Annotated[str | None, PATH] = Field(
        None, description="python of the environment with vLLM (default: $EAGLEKIT_VLLM_PYTHON, then .venv-vllm)"
    )
    engine_args: list[str] = Field(
        default_factory=list,
        description="extra flags for the engine eaglekit starts, e.g. [--tensor-parallel-size, '8']",
    )
    formats: list[Literal["eagle3", "speculators"]] | None = Field(
        None, description="exported forms to serve (engine: vllm); default: those export wrote"
    )
    num_speculative_tokens: list[PositiveInt] | None = Field(
        None, min_length=1, description="K values to serve (engine: vllm); default: [export.num_speculative_tokens]"
    )
    num_samples: int | None = Field(None, ge=1, description="prompts sent; default evaluate.num_samples")
    max_new_tokens: int | None = Field(None, ge=1, description="default evaluate.max_new_tokens")
    tau_tolerance: float = Field(
        0.01,
        ge=0.0,
        description="largest |served τ - offline τ| / offline τ that passes (docs/verify.md: 'Tolerances': 0 "
        "measured in float32 and bfloat16; aux ids shifted by one: 2.7% at K=3)",
    )
    position_tolerance: float = Field(
        0.02,
        ge=0.0,
        description="largest |served - offline| acceptance rate at any draft position that passes "
        "(aux ids shifted by one: 0.045 at K=3)",
    )
    greedy_tolerance: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of prompts whose served greedy output may differ from plain decoding "
        "(0 in float32; bfloat16 kernels may flip near-ties on long outputs)",
    )
    suites: list[SuiteConfig] | None = Field(None, description="benchmark suites served; default evaluate.suites")
    startup_timeout: float = Field(900.0, gt=0, description="seconds to wait for an engine eaglekit starts")
    timeout: float = Field(600.0, gt=0, description="seconds per request")

    @field_validator("suites", mode="before")
    @classmethod
    def _bare_suite_names(cls, value: Any) -> Any:
        return bare_suite_names(value)

    def check_runnable(self, source: str) -> None:
        """Refuses, naming ``source`` (the config file), an engine to start and a server to use at once."""
        if self.engine and self.server:
            raise UsageError(
                f"{source}: verify.engine and verify.server are both set",
                "set verify.engine to let eaglekit start the engine, or verify.server for one you started",
            )

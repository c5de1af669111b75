"""``generate``: sampling the target's replies to the prompts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from eaglekit.config.base import Seed, ServerPoolConfig
from eaglekit.errors import UsageError


class GenerateConfig(ServerPoolConfig):
    """Sampling the target's replies; the server-pool keys (ServerPoolConfig) are for the openai backend."""

    backend: Literal["local", "openai"] = "local"
    max_tokens: int = Field(512, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    reasoning: Literal["required", "optional", "off"] | None = Field(
        None,
        description="default: required when the target's chat template has think tags, else optional; "
        "YAML's on/yes/true mean required, off/no/false mean off",
    )
    gate_samples: int = Field(20, ge=1, description="completions checked by the reasoning gate")
    gate_max_empty_share: float = Field(0.1, ge=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, description="local backend: prompts per generate() call")
    seed: Seed = 0
    extra_body: dict[str, Any] = Field(default_factory=dict)
    return_token_ids: bool = True

    @field_validator("reasoning", mode="before")
    @classmethod
    def _yaml_boolean(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` / `on` as a boolean: take it as the choice it spells
        if isinstance(value, bool):
            return "required" if value else "off"
        return value

    def check_runnable(self, source: str) -> None:
        """Refuses, naming ``source`` (the config file), the openai backend without its servers or served model id."""
        if self.backend == "openai":
            if not self.servers:
                raise UsageError(
                    f"{source}: generate.backend is 'openai' but generate.servers is empty",
                    "list the servers' base URLs, e.g. servers: [http://host:8000/v1]",
                )
            if not self.model:
                raise UsageError(
                    f"{source}: generate.backend is 'openai' but generate.model is not set",
                    "set generate.model to the id the server lists under /v1/models",
                )

"""What every section shares: the base model (unknown keys refused, 64-bit integers, no inf or nan), the value
types its keys use (dtype aliases, seeds, bounded numbers), the server-pool keys of generate and extract.vllm, and
the deprecated spellings of moved keys (a ConfigDeprecation, shown at the key's line of the config file)."""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

# What users type for a dtype, and the name eaglekit (and torch) uses for it.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "e4m3": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}


def _dtype_alias(value: Any) -> Any:
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        return DTYPE_ALIASES.get(name, name)
    return value


# A dtype key accepts the aliases users type (bf16, fp16, fp32, ...) and stores eaglekit's name for it.
DtypeAlias = BeforeValidator(_dtype_alias)


# torch.manual_seed, random.seed and numpy's legacy np.random.seed (train seeds all three) all take this range.
SEED_LIMIT = 2**32
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT, description="0 <= seed < 2**32 (numpy's seed range)")]
INT64_LIMIT = 2**63  # torch tensors, numpy and the JSON servers take hold integers in 64 bits
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0.0)]


class Section(BaseModel):
    # inf and nan mean nothing for any float key (a rate, a share, a timeout); `gt=0` alone lets inf through
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_64_bits(cls, value: Any) -> Any:
        # a count past 2**63 passes every `ge` but overflows the first tensor or seed it reaches
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and not -INT64_LIMIT <= item < INT64_LIMIT:
                raise ValueError("must fit in 64 bits (below 2**63)")
        return value


class ServerPoolConfig(Section):
    """A pool of OpenAI-compatible servers, as ``serving.client`` drives it: generate's openai backend and
    extract's vLLM backend. Each section keeps its own defaults where the two workloads differ."""

    servers: list[str] = Field(default_factory=list, description="base URLs ending in /v1")
    model: str | None = Field(None, description="served model id")
    api_key_env: str | None = Field(None, description="name of the env variable holding the API key")
    concurrency: int = Field(16, ge=1, description="in-flight requests per server")
    timeout: float = Field(600.0, gt=0, description="seconds per request")
    max_retries: int = Field(5, ge=0)
    retry_backoff: float = Field(
        1.0, ge=0.0, description="seconds before the first retry; doubles per attempt, jittered"
    )
    probe_interval: float = Field(
        30.0, gt=0, description="seconds before a server taken out of rotation is tried again"
    )
    outage_timeout: float = Field(
        600.0, gt=0, description="seconds the run waits while every server is out of rotation"
    )


class ConfigDeprecation(FutureWarning):
    """A key loaded under an old spelling (a FutureWarning: Python shows it to users by default); ``section`` and
    ``key`` are where it stands in the config (the warning is shown at that line of the file)."""

    def __init__(self, message: str, section: str = "", key: str = "") -> None:
        super().__init__(message)
        self.section, self.key = section, key


def line_of_key(text: str, section: str, key: str) -> int:
    """The 1-based line of ``key`` inside the top-level ``section`` of a YAML config's ``text``; 0 when not found
    (a flow mapping, an anchor: the message still names the key)."""
    lines = text.splitlines()
    top = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(section)}\s*:", line)), None)
    if top is None:
        return 0
    for i in range(top + 1, len(lines)):
        line = lines[i]
        if line and not line[0].isspace() and not line.startswith("#"):
            return 0  # the next section
        if re.match(rf"\s+{re.escape(key)}\s*:", line):
            return i + 1
    return 0


def move_old_spellings(data: Any, moved: dict[str, str], section: str) -> Any:
    """A section's raw keys with the old spellings in ``moved`` (old key: its new dotted path, both inside
    ``section``) moved to their new place, each with a ConfigDeprecation naming both; old and new spelling of one
    key together are refused. Where the new path runs through a bare name (``loss: lk_hybrid``, then ``lk_eta``
    joins it), the name becomes ``{name: ...}``, what the shorthand means."""
    if not isinstance(data, dict) or not any(old in data for old in moved):
        return data
    data = dict(data)
    for old, new in moved.items():
        if old not in data:
            continue
        value = data.pop(old)
        *parents, leaf = new.split(".")
        node = data
        for part in parents:
            child = node.get(part)
            if child is None or isinstance(child, str):
                child = {} if child is None else {"name": child}
            if not isinstance(child, dict):
                raise ValueError(f"{section}.{old} moves into {section}.{'.'.join(parents)}, which is not a mapping")
            node[part] = node = dict(child)
        if leaf in node:
            raise ValueError(f"{section}.{old} and {section}.{new} are both set: keep {section}.{new} only")
        node[leaf] = value
        warnings.warn(
            ConfigDeprecation(
                f"{section}.{old} is an old spelling: write {section}.{new} (the old one still loads, for now)",
                section,
                old,
            ),
            stacklevel=2,
        )
    return data

"""The run config: one YAML file, validated by pydantic, one section per stage (each in its module here).

Unknown keys are an error that names the key (a typo such as ``max_token`` must never be silently
ignored for a twelve-hour run). Keys that name a file or folder carry a ``ConfigPath`` marker in their type;
``parse_config`` finds them in the schema and resolves relative ones against the folder of the config file.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from eaglekit.config.base import ConfigDeprecation, Section, line_of_key
from eaglekit.config.data import DataConfig
from eaglekit.config.evaluate import EvaluateConfig
from eaglekit.config.export import ExportConfig
from eaglekit.config.extract import ExtractConfig
from eaglekit.config.generate import GenerateConfig
from eaglekit.config.paths import PATH, resolve_paths
from eaglekit.config.preflight import PreflightConfig
from eaglekit.config.prepare import PrepareConfig
from eaglekit.config.target import TargetConfig
from eaglekit.config.train import TrainConfig
from eaglekit.config.verify import VerifyConfig
from eaglekit.config.vocab import VocabConfig
from eaglekit.errors import UsageError


class RunConfig(Section):
    run_dir: Annotated[str, PATH] = Field(min_length=1)
    target: TargetConfig
    data: DataConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)

    # Where the config was read from; not a key of the file.
    source: Path | None = Field(None, exclude=True)

    @field_validator("run_dir")
    @classmethod
    def _names_a_folder(cls, value: str) -> str:
        if not value.strip():  # a blank path would be the current directory
            raise ValueError("must name a directory (it is blank)")
        return value

    @model_validator(mode="after")
    def _context_parallel_reads_offline_features(self) -> RunConfig:
        if self.train.context_parallel > 1 and not self.extract.offline:
            raise ValueError(
                f"train.context_parallel is {self.train.context_parallel} with {self.extract.mode} features: every "
                "rank would run (online) or request (stream) the target's features of the whole row, which is what "
                "does not fit; set extract.mode: offline (each rank then reads only its share of the row's stored "
                "features)"
            )
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude={"source"}), sort_keys=False)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for e in err.errors():
        key = ".".join(str(part) for part in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{key}' (check the spelling; see docs/config.md)")
        elif e["type"] == "missing":
            lines.append(f"  - missing required key '{key}'")
        elif not key:  # a check across sections (RunConfig's own validators): its message names the keys
            lines.append(f"  - {e['msg'].removeprefix('Value error, ')}")
        elif isinstance(e.get("input"), bool):
            lines.append(
                f"  - '{key}': {e['msg']} (got {e['input']!r}: YAML reads unquoted yes/no/on/off/true/false "
                f'as a boolean; quote the value, e.g. "off")'
            )
        else:
            lines.append(f"  - '{key}': {e['msg'].removeprefix('Value error, ')} (got {_shown(e.get('input'))})")
    return "\n".join(lines)


def _shown(value: Any, limit: int = 80) -> str:
    """A value as the error line quotes it: cut short, since a config key can hold a megabyte string."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None, text: str | None = None
) -> RunConfig:
    """The run config of ``data`` (a YAML mapping) read from ``source`` (its ``text``: warnings name its lines)."""
    if not isinstance(data, dict):
        raise UsageError(
            f"{source}: the config must be a YAML mapping of sections, got {type(data).__name__}",
            "start from the config that `eaglekit demo` writes into its run directory",
        )
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise UsageError(_format_validation_error(err, source), "fix the named keys") from None
    finally:
        for w in said:  # an old spelling is the config file's, not a line of eaglekit's: shown at its line there
            said_of = w.message
            if isinstance(said_of, ConfigDeprecation):
                line = line_of_key(text, said_of.section, said_of.key) if text else 0
                warnings.warn_explicit(said_of, ConfigDeprecation, source, line)
            else:
                warnings.warn_explicit(said_of, w.category, w.filename, w.lineno)
    resolve_paths(cfg, base_dir or Path.cwd())
    blocking = next((p for p in (cfg.run_path, *cfg.run_path.parents) if p.exists() or p.is_symlink()), None)
    if blocking is not None and not blocking.is_dir():
        raise UsageError(
            f"{source}: run_dir {cfg.run_dir} cannot be a directory: {blocking} is "
            + ("a broken symlink" if blocking.is_symlink() and not blocking.exists() else "a file"),
            "set run_dir to a new or existing directory",
        )
    for section in (cfg.extract, cfg.verify, cfg.generate):
        section.check_runnable(source)
    return cfg


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read and validate a run config; every problem is a UsageError naming the file and key."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"config file not found: {path}", "pass the path of a YAML run config (eaglekit demo writes one)"
        )
    if path.is_dir():
        raise UsageError(f"config path is a directory: {path}", "pass the YAML file, e.g. RUN_DIR/config.yaml")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UsageError(
            f"{where}: not valid YAML ({getattr(err, 'problem', err)})", "fix the YAML syntax at that line"
        ) from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a UTF-8 text file", "pass the YAML run config") from None
    except ValueError as err:  # YAML's int() of a number longer than Python converts (4300 digits)
        raise UsageError(f"{path}: a value YAML cannot read ({err})", "fix that value") from None
    except RecursionError:
        raise UsageError(
            f"{path}: nested deeper than the YAML reader can follow", "a run config is sections of keys: flatten it"
        ) from None
    cfg = parse_config(data, source=str(path), base_dir=path.resolve().parent, text=text)
    cfg.source = path.resolve()
    return cfg

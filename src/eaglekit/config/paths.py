"""Keys that name a file or folder: a ``ConfigPath`` marker in their type, which ``resolve_paths`` finds in the
schema to resolve a relative value against the config file's folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class ConfigPath:
    """Marks a key that names a file or folder: parse_config resolves a relative value against the config's folder."""

    hub_ok: bool = False  # an ``org/name`` hub id that is not a local folder stays as it is
    inline_prefix: str | None = None  # a value starting with this is the content itself (an inline chat template)


# Markers for Annotated[...] on the whole field type (``Annotated[str | None, PATH]``), where pydantic keeps them.
PATH = ConfigPath()
PATH_OR_HUB_ID = ConfigPath(hub_ok=True)
TEMPLATE_OR_PATH = ConfigPath(inline_prefix="{")


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "/", "~"))


def _resolve(base: Path, value: str, marker: ConfigPath) -> str:
    """A path resolved against the config's folder; a hub id that is not a local folder, or inline content, as is."""
    if marker.inline_prefix and value.lstrip().startswith(marker.inline_prefix):
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = (base / p).resolve()
    if marker.hub_ok and _looks_like_hub_id(value) and not candidate.exists():
        return value
    return str(candidate)


def _path_marker(field: FieldInfo) -> ConfigPath | None:
    return next((m for m in field.metadata if isinstance(m, ConfigPath)), None)


def resolve_paths(section: BaseModel, base: Path) -> None:
    """Resolve every key marked as a path (ConfigPath), in this section and the sections below it."""
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            resolve_paths(value, base)
        elif isinstance(value, list):  # e.g. evaluate.suites
            for item in value:
                if isinstance(item, BaseModel):
                    resolve_paths(item, base)
        elif isinstance(value, str) and value and (marker := _path_marker(field)):
            setattr(section, name, _resolve(base, value, marker))

"""Reading a job spec and wording its errors: the YAML loader that refuses duplicate keys, dotted overrides, and
the one-line-per-problem message with the nearest valid key. :mod:`ray_cluster_ft.config` re-exports what is
public here (``ConfigError``) and calls the rest from ``load_config`` and ``parse_config``; this module imports
nothing of the package, so the schema can use it without an import cycle.
"""

from __future__ import annotations

import difflib
import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "format_errors", "read_spec"]


class ConfigError(ValueError):
    """A job config that cannot run: unknown key, wrong type, or impossible combination of values."""


# Public as ray_cluster_ft.config.ConfigError (re-exported there): tracebacks and pickles name it so.
ConfigError.__module__ = "ray_cluster_ft.config"


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at ``loc`` (the location of an unknown key) in the config tree."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return list(cls.model_fields)


# A hostile YAML file can alias one node many times (a "billion laughs"); a plain repr of the offending value
# would expand every alias, so error messages show a bounded repr.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def format_errors(err: ValidationError, root: type[BaseModel]) -> str:
    """``err`` as the config error message: one line per problem, an unknown key with the nearest valid one in
    ``root``'s tree (did-you-mean) and the keys valid there, any other problem with its key and bounded input."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(root, loc)
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f"; did you mean '{'.'.join(map(str, loc[:-1] + (near[0],)))}'?" if near else ""
            lines.append(f"unknown key '{key}'{hint} (valid here: {', '.join(valid)})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # A check across sections names its keys itself; the input would be the whole config.
            lines.append(msg if not loc else f"{key}: {msg} (got {_REPR.repr(e.get('input'))})")
    return "invalid job config:\n  " + "\n  ".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping: PyYAML keeps the last one silently, so
    a second ``train:`` section would drop the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` is flattened by SafeLoader itself
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let SafeLoader raise its own error
                break
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_spec(path: str | Path, overrides: dict | None = None) -> dict:
    """The mapping a YAML job spec holds, with ``overrides`` (dotted keys to values) applied; not validated.

    Raises:
        ConfigError: the file is missing or not a regular file, is not YAML (a duplicate key included), does
            not hold a mapping, or an override goes through a value that is not a mapping.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"job config {p} is a directory, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"job config not found: {p}" if not p.exists() else f"job config {p} is not a regular file")
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"job config {p} is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"job config {p} is not valid YAML: nested too deeply") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid job config: {p} must hold a mapping of sections, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parents[: i + 1])
                raise ConfigError(f"cannot set '{dotted}': '{where}' in {p} is a {type(node).__name__}, not a mapping")
        node[leaf] = value
    return raw

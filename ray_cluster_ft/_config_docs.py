"""``docs/config.md``, generated from the config models: every section of :class:`~ray_cluster_ft.config.JobConfig`
as one table (key, type, default, constraints, description) under its class docstring, then the presets.

    python -m ray_cluster_ft._config_docs            # write docs/config.md
    python -m ray_cluster_ft._config_docs --check    # exit 1 when docs/config.md differs

The output depends only on the models and :data:`ray_cluster_ft.config.PRESETS` (fields in declaration order),
so it is the same on every machine; ``tests/test_config_docs.py`` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .config import PRESETS, JobConfig

__all__ = ["COMMAND", "DOC_PATH", "render", "main"]

COMMAND = "python -m ray_cluster_ft._config_docs"
"""The command that regenerates ``docs/config.md`` (named by the staleness test)."""

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
"""``docs/config.md`` of the checkout this package was imported from."""


def _md(text: str) -> str:
    """reStructuredText bits of a docstring or description as Markdown: ``x`` and :func:`x` become `x`."""
    text = re.sub(r":(?:func|class|data|mod|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _cell(text: str) -> str:
    """``text`` fit for one table cell: one line, pipes escaped."""
    return _md(" ".join(text.split())).replace("|", "\\|")


def _value(v: Any) -> str:
    """A value as YAML would spell it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _type(ann: Any) -> str:
    """The type of a field in words: ``int``, ``list of str``, a Literal's values, ``... or null``."""
    if ann is type(None):
        return "null"
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return ", ".join(f"`{_value(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin is list:
        return f"list of {_type(args[0])}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(f: FieldInfo) -> str:
    v = f.default_factory() if f.default_factory is not None else f.default
    return "" if isinstance(v, BaseModel) else f"`{_value(v)}`"


def _constraints(f: FieldInfo) -> str:
    """The field's bounds (``>= 1``, ``< 1``) and length limits, in words."""
    out = []
    is_text = f.annotation is str or str in get_args(f.annotation)
    for m in f.metadata:
        for cls, op in ((at.Ge, ">="), (at.Gt, ">"), (at.Le, "<="), (at.Lt, "<")):
            if isinstance(m, cls):
                out.append(f"{op} {_value(getattr(m, cls.__name__.lower()))}")
        if isinstance(m, at.MinLen) and m.min_length:
            out.append("non-empty" if is_text or m.min_length == 1 else f"at least {m.min_length} items")
        if isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length}")
    return ", ".join(out)


def _is_section(f: FieldInfo) -> bool:
    return isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """``(dotted name, model)`` of every section under ``model``, depth first, in declaration order."""
    out = []
    for name, f in model.model_fields.items():
        if _is_section(f):
            out.append((prefix + name, f.annotation))
            out += _sections(f.annotation, f"{prefix}{name}.")
    return out


def _doc(cls: type) -> str:
    return _md(inspect.cleandoc(cls.__doc__ or ""))


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        key = f"`{prefix}{name}`"
        if _is_section(f):
            anchor = (prefix + name).replace(".", "")
            key, desc = f"[`{prefix}{name}`](#{anchor})", f.description or ""
        else:
            desc = f.description or ""
        rows.append(f"| {key} | {_cell(_type(f.annotation))} | {_default(f)} | {_cell(_constraints(f))} "
                    f"| {_cell(desc)} |")
    return rows


def _flat(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return out


def render() -> str:
    """The whole of ``docs/config.md``."""
    sections = _sections(JobConfig)
    lines = [
        f"<!-- Generated from ray_cluster_ft/config.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "# Job config reference",
        "",
        "A job spec is a YAML file; `ray-cluster-ft check SPEC.yaml` validates one and prints it with every "
        "default filled in. The tables below are generated from the field descriptions in "
        "`ray_cluster_ft/config.py`, which are the reference.",
        "",
        _doc(JobConfig),
        "",
        "Sections: " + ", ".join(f"[`{n}`](#{n.replace('.', '')})" for n, _ in sections) + "; [presets](#presets).",
        "",
        "## Top level",
        "",
        *_table(JobConfig, ""),
    ]
    for name, model in sections:
        lines += ["", f"## {name}", "", _doc(model), "", *_table(model, name + ".")]
    lines += ["", "## Presets", "",
              "`preset: NAME` fills in these keys before validation; a key written in the spec overrides the "
              "preset's (`ray-cluster-ft check` prints the resolved config)."]
    for name, keys in PRESETS.items():
        lines += ["", f"### `{name}`", "", "| key | value |", "| --- | --- |"]
        lines += [f"| `{k}` | `{_value(v)}` |" for k, v in _flat(keys)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write ``docs/config.md`` (or, with ``--check``, return 1 when it differs from :func:`render`)."""
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file is stale; write nothing")
    ap.add_argument("--output", type=Path, default=DOC_PATH, help=f"default: {DOC_PATH}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = args.output.is_file() and args.output.read_text(encoding="utf-8") == text
        print(f"{args.output} is up to date" if same else f"{args.output} is stale: run `{COMMAND}`")
        return 0 if same else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

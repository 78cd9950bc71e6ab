"""Render a config schema as `--help` text: one line per field with its type, default and docstring."""

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def render_help(command: str, summary: str, schema: type[BaseModel]) -> str:
    lines = [
        f"usage: tidal {command} [@ config.toml ...] [--key.path value ...] [--dry-run] [--help]",
        "",
        summary,
        "",
        "Config files merge left to right, then --dotted.key overrides (booleans: --flag / --no-flag).",
        "--dry-run prints the resolved config and exits.",
        "",
        "options:",
    ]
    _render_fields(schema, "", lines)
    return "\n".join(lines)


def _render_fields(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        doc = (info.description or "").replace("\n", " ")
        variants = _models_in(info.annotation)
        if len(variants) == 1 and _is_plain_model(info.annotation):
            lines.append(f"  [{key}]  {doc or variants[0].__doc__ or ''}".rstrip())
            _render_fields(variants[0], key + ".", lines)
            continue
        if variants:
            lines.append(f"  [{key}]  {doc}  (one of: {', '.join(_tag(v) for v in variants)})")
            for variant in variants:
                lines.append(f"    type = {_tag(variant)!r}: {variant.__doc__ or ''}".rstrip())
                _render_fields(variant, key + ".", lines)
            continue
        default = "" if info.default is PydanticUndefined else f" (default: {_show(info.default)})"
        required = " (required)" if info.is_required() else ""
        lines.append(f"  --{key.replace('_', '-')} {_type_name(info.annotation)}{required}{default}")
        if doc:
            lines.append(f"      {doc}")


def _is_plain_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if _is_plain_model(annotation):
        return [annotation]
    found: list[type[BaseModel]] = []
    if typing.get_origin(annotation) is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found


def _tag(model: type[BaseModel]) -> str:
    info = model.model_fields.get("type")
    return str(info.default) if info is not None else model.__name__


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "{" + "|".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        return (
            " | ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None)) + " | none"
        )
    if origin is not None:
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation)).upper()


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    return repr(value) if isinstance(value, str) else str(value)

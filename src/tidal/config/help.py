"""Render a command's options as `--help` text, with the defaults that command resolves (not the classes').

Each value is shown as the TOML literal `--key VALUE` would take; `unset` stands for None. `--help` shows
the options the schema names in `HELP_MAIN`; `--help-all` every option. Keys a command sets itself from
elsewhere in its config (`SET_ELSEWHERE`) are left out: setting them is an error.
"""

import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

Key = tuple[str, ...]
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])")
UNSET = "unset"


@dataclass
class _Render:
    hidden: set[Key]
    main: tuple[str, ...] | None
    """Dotted prefixes of the options `--help` shows; None: all of them."""
    full: bool
    lines: list[str] = field(default_factory=list)
    left_out: int = 0
    other_variant: bool = False
    in_unset_table: bool = False
    """Rendering the fields of a table that is unset by default: their defaults apply once it is set."""
    """Rendering a variant the config does not use: its defaults apply once `type` selects it."""

    def wanted(self, key: Key) -> bool:
        if self.main is None:
            return True
        dotted = ".".join(key)
        return any(dotted == p or dotted.startswith(p + ".") for p in self.main)

    def leads_to_wanted(self, key: Key) -> bool:
        if self.main is None:
            return True
        dotted = ".".join(key) + "."
        return self.wanted(key) or any(p.startswith(dotted) for p in self.main)


def render_help(
    command: str, summary: str, schema: type[BaseModel], resolved: BaseModel | None, full: bool
) -> str:
    """`resolved`: the command's config resolved from the given files and flags (None when it does not
    validate yet, e.g. a required key is missing: then each table's own defaults are shown)."""
    main = None if full else getattr(schema, "HELP_MAIN", None)
    render = _Render(hidden=set(getattr(schema, "SET_ELSEWHERE", {})), main=main, full=full)
    _fields(render, schema, resolved, ())
    head = [
        f"usage: tidal {command} [@ config.toml ...] [--key.path value ...] [--dry-run] [--help | --help-all]",
        "",
        summary,
        "",
        "Config files merge left to right, then --dotted.key overrides (booleans: --flag / --no-flag).",
        "Values are TOML literals; `unset` marks an option that is off or derived when not set.",
        "Defaults are the ones this command resolves"
        + (" with the given files and flags." if resolved else "."),
        "--dry-run prints the resolved config and exits.",
        "",
        "options:" if full or main is None else "main options:",
    ]
    tail = []
    if render.left_out:
        tail = ["", f"{render.left_out} more options: tidal {command} --help-all"]
    return "\n".join(head + render.lines + tail)


def _fields(render: _Render, model: type[BaseModel], value: BaseModel | None, prefix: Key) -> None:
    for name, info in model.model_fields.items():
        key = (*prefix, name)
        if key in render.hidden or (name == "type" and _tag(model) == info.default and value is None):
            continue  # a variant's tag: its heading says `type = ...`
        current = getattr(value, name) if value is not None else _field_default(info)
        doc = (info.description or "").strip()
        annotation = _strip_none(info.annotation)
        variants = _models_in(annotation)
        if variants and not _is_list(annotation):
            _table(render, key, doc, variants, current)
        else:
            _option(render, key, info, doc, current, variants)


def _table(render: _Render, key: Key, doc: str, variants: list[type[BaseModel]], current: Any) -> None:
    if not render.leads_to_wanted(key):
        render.left_out += _count_options(variants)
        return
    chosen = current if isinstance(current, BaseModel) else None
    note = ""
    if current is PydanticUndefined:
        note = " (required)"
    elif chosen is None:
        note = f" ({UNSET} by default)"
    if len(variants) == 1:
        render.lines.append(f"  [{'.'.join(key)}]{note}  {_doc(render, doc or variants[0].__doc__)}".rstrip())
        outer, render.in_unset_table = (
            render.in_unset_table,
            render.in_unset_table or note.endswith("default)"),
        )
        _fields(render, variants[0], chosen, key)
        render.in_unset_table = outer
        return
    tags = ", ".join(repr(_tag(v)) for v in variants)
    render.lines.append(f"  [{'.'.join(key)}]{note}  {_doc(render, doc)}  (type: one of {tags})".rstrip())
    for variant in variants:
        is_chosen = chosen is not None and type(chosen) is variant
        label = " (the default)" if is_chosen else ""
        render.lines.append(f"   type = {_tag(variant)!r}{label}: {_doc(render, variant.__doc__)}".rstrip())
        render.other_variant = not is_chosen
        _fields(render, variant, chosen if is_chosen else None, key)
        render.other_variant = False


def _option(
    render: _Render, key: Key, info: Any, doc: str, current: Any, entries: list[type[BaseModel]]
) -> None:
    if not render.wanted(key):
        render.left_out += 1
        return
    flag = "--" + ".".join(key).replace("_", "-")
    if current is PydanticUndefined:
        shown = " (required)"
    elif render.other_variant:
        shown = f" (default with this type: {show(current)})"
    elif render.in_unset_table:
        shown = f" (default once the table is set: {show(current)})"
    else:
        shown = f" (default: {show(current)})"
    render.lines.append(f"  {flag} {_type_name(info.annotation)}{shown}")
    if doc:
        render.lines.append(f"      {_doc(render, doc)}")
    for entry in entries:  # a list of tables: what one entry holds
        parts = [f"{n} {_type_name(i.annotation)}" for n, i in entry.model_fields.items()]
        render.lines.append(f"      each table: {', '.join(parts)}")


def _field_default(info: Any) -> Any:
    if info.is_required():
        return PydanticUndefined
    return info.get_default(call_default_factory=True)


def _doc(render: _Render, text: str | None) -> str:
    """The whole docstring with --help-all; its first sentence with --help."""
    flat = " ".join((text or "").split())
    if render.full or render.main is None:
        return flat
    end = _SENTENCE_END.search(flat)
    return flat if end is None else flat[: end.start() + 1]


def _count_options(variants: Iterable[type[BaseModel]]) -> int:
    total = 0
    for variant in variants:
        for info in variant.model_fields.values():
            nested = _models_in(_strip_none(info.annotation))
            is_table = nested and not _is_list(_strip_none(info.annotation))
            total += _count_options(nested) if is_table else 1
    return total


def _strip_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


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
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return "{" + "|".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(annotation) if a is not type(None)]
        return " | ".join(dict.fromkeys(names))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        inner = " | ".join(dict.fromkeys(_type_name(a) for a in args)) or "ANY"
        return f"LIST[{inner}]"
    if origin is dict:
        return "TABLE"
    if _is_plain_model(annotation):
        return "TABLE"
    return getattr(annotation, "__name__", str(annotation)).upper()


def show(value: Any) -> str:
    """`value` as the TOML literal that `--key VALUE` reads back (`unset` for None)."""
    if value is None:
        return UNSET
    if isinstance(value, BaseModel):
        return show(value.model_dump(mode="json", exclude_none=True))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        body = ", ".join(f"{_bare_key(k)} = {show(v)}" for k, v in value.items() if v is not None)
        return "{" + body + "}" if body else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _bare_key(name: Any) -> str:
    text = str(name)
    return text if text.replace("_", "").replace("-", "").isalnum() else show(text)

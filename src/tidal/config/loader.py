"""Turn `@ a.toml @ b.toml --x.y value` into a validated config, or one clear line naming file and key."""

import difflib
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tidal.config.base import ConfigProblem
from tidal.errors import UserError

CLI_SOURCE = "command line"
Key = tuple[str, ...]
T = TypeVar("T", bound=BaseModel)


@dataclass
class RawConfig:
    """Merged raw values plus where each leaf came from (a file path or the command line)."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[Key, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


@dataclass
class ParsedArgs:
    """A command's arguments split into config files, dotted overrides and the CLI's own flags."""

    files: list[str] = field(default_factory=list)
    overrides: list[tuple[str, Any]] = field(default_factory=list)
    help: bool = False
    help_all: bool = False
    dry_run: bool = False


def config_error(source: str, key: str, message: str) -> UserError:
    where = f"{source}: {key}: " if key else f"{source}: "
    return UserError(where + message, exit_code=2)


def parse_args(argv: Sequence[str]) -> ParsedArgs:
    """Split argv (after the command name). Values are parsed as TOML literals, falling back to strings."""
    parsed = ParsedArgs()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or (arg.startswith("@") and len(arg) > 1):
            if arg == "@":
                if i + 1 >= len(argv):
                    raise config_error(CLI_SOURCE, "", "'@' must be followed by a config file path")
                i += 1
                parsed.files.append(argv[i])
            else:
                parsed.files.append(arg[1:])
        elif arg in ("-h", "--help"):
            parsed.help = True
        elif arg == "--help-all":
            parsed.help = parsed.help_all = True
        elif arg == "--dry-run":
            parsed.dry_run = True
        elif arg.startswith("--") and len(arg) > 2:
            name = arg[2:]
            if "=" in name:
                name, text = name.split("=", 1)
                parsed.overrides.append((_key_name(name), parse_value(text)))
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and not argv[i + 1].startswith("@"):
                i += 1
                parsed.overrides.append((_key_name(name), parse_value(argv[i])))
            elif name.startswith("no-"):
                parsed.overrides.append((_key_name(name[3:]), False))
            else:
                parsed.overrides.append((_key_name(name), True))
        else:
            raise config_error(
                CLI_SOURCE,
                "",
                f"unexpected argument {arg!r} (config files go after '@', overrides are --key value)",
            )
        i += 1
    return parsed


def _key_name(name: str) -> str:
    return name.replace("-", "_")


def parse_value(text: str) -> Any:
    """`3e-4` -> float, `true` -> bool, `[1, 2]` -> list, anything that is not a TOML literal -> str."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_raw(files: Sequence[str], overrides: Sequence[tuple[str, Any]]) -> RawConfig:
    """Deep-merge the files left to right (tables merge, everything else replaces), then the overrides."""
    raw = RawConfig()
    for file in files:
        raw.files.append(file)
        _merge(raw, _read_toml(file), (), file)
    for dotted, value in overrides:
        key = tuple(dotted.split("."))
        if any(not part for part in key):
            raise config_error(CLI_SOURCE, dotted, "malformed key")
        parent = raw.data
        for depth, part in enumerate(key[:-1]):
            child = parent.setdefault(part, {})
            if not isinstance(child, dict):
                raise config_error(
                    CLI_SOURCE, dotted, f"'{'.'.join(key[: depth + 1])}' is a value, not a table"
                )
            parent = child
        if isinstance(value, dict):  # an inline table on the command line replaces the whole table
            parent[key[-1]] = {}
            _merge(raw, value, key, CLI_SOURCE)
        else:
            parent[key[-1]] = value
            raw.sources[key] = CLI_SOURCE
    return raw


def _read_toml(file: str) -> dict[str, Any]:
    path = Path(file)
    if not path.is_file():
        raise config_error(file, "", "no such config file" if not path.exists() else "not a file")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise config_error(file, "", f"invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise config_error(file, "", f"cannot read: {exc}") from None


def _merge(raw: RawConfig, new: dict[str, Any], prefix: Key, source: str) -> None:
    target: dict[str, Any] = raw.data
    for part in prefix:
        target = target.setdefault(part, {})
    for name, value in new.items():
        key = (*prefix, name)
        existing = target.get(name)
        if isinstance(value, dict) and isinstance(existing, dict) and not _switches_variant(existing, value):
            _merge(raw, value, key, source)
        elif isinstance(value, dict):
            target[name] = {}
            _merge(raw, value, key, source)
            raw.sources.setdefault(key, source)
        else:
            target[name] = value
            raw.sources[key] = source


def _switches_variant(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """A table that changes its `type` starts afresh: the old variant's keys would be unknown to the new one."""
    return "type" in new and "type" in old and new["type"] != old["type"]


def validate(schema: type[T], raw: RawConfig) -> T:
    """Validate raw values against the schema; the first problem becomes a one-line UserError."""
    try:
        return schema.model_validate(raw.data)
    except ValidationError as exc:
        raise _describe(schema, raw, exc.errors()[0]) from None


def load_config(schema: type[T], files: Sequence[str], overrides: Sequence[tuple[str, Any]]) -> T:
    return validate(schema, load_raw(files, overrides))


def _describe(schema: type[BaseModel], raw: RawConfig, error: Any) -> UserError:
    key = _clean_loc(error["loc"], raw.data)
    ctx = error.get("ctx") or {}
    problem = ctx.get("error")
    if isinstance(problem, ConfigProblem):
        return _blame(key, problem, raw)
    dotted = ".".join(key)
    kind = error["type"]
    if kind == "extra_forbidden":
        hint = _suggest(schema, key, raw.data)
        return config_error(_source_for(key, raw), dotted, "unknown key" + hint)
    if kind == "missing":
        source = raw.files[-1] if raw.files else CLI_SOURCE
        return config_error(source, dotted, "missing required key")
    message = error["msg"]
    if "input" in error and not isinstance(error["input"], dict):
        message += f" (got {error['input']!r})"
    return config_error(_source_for(key, raw), dotted, message)


def _blame(base: Key, problem: ConfigProblem, raw: RawConfig) -> UserError:
    """A combination problem, reported where the user wrote the part that made it one: the command line when
    any key involved came from it (overrides apply last), else the key's file."""
    key = (*base, *problem.key.split("."))
    source = _source_for(key, raw)
    for other in problem.also:
        other_key = (*base, *other.split("."))
        if source != CLI_SOURCE and raw.sources.get(other_key) == CLI_SOURCE:
            where = (
                f"{key_text(key)} from {source}" if source != "defaults" else f"{key_text(key)} by default"
            )
            return config_error(CLI_SOURCE, key_text(other_key), f"{problem} ({where})")
    return config_error(source, key_text(key), str(problem))


def key_text(key: Key) -> str:
    return ".".join(key)


def _clean_loc(loc: Sequence[Any], data: Any) -> Key:
    """Drop the variant tags pydantic inserts for discriminated unions (`data.train.file.path`)."""
    key: list[str] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("type") == part:
            continue
        key.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return tuple(key)


def _source_for(key: Key, raw: RawConfig) -> str:
    for depth in range(len(key), 0, -1):
        if key[:depth] in raw.sources:
            return raw.sources[key[:depth]]
    for known, source in raw.sources.items():
        if known[: len(key)] == key:
            return source
    return ", ".join(raw.files) if raw.files else "defaults"


def _suggest(schema: type[BaseModel], key: Key, data: dict[str, Any]) -> str:
    model = _model_at(schema, key[:-1], data)
    if model is None:
        return ""
    hint = getattr(model, "UNKNOWN_KEY_HINTS", {}).get(key[-1])
    if hint is not None:
        return f": {hint}"
    close = difflib.get_close_matches(key[-1], list(model.model_fields), n=1)
    return f" (did you mean '{'.'.join((*key[:-1], close[0]))}'?)" if close else ""


def _model_at(schema: type[BaseModel], key: Key, data: Any) -> type[BaseModel] | None:
    model: type[BaseModel] = schema
    for part in key:
        info = model.model_fields.get(part)
        data = data.get(part) if isinstance(data, dict) else None
        if info is None:
            return None
        nested = _model_choices(info.annotation)
        chosen = [m for m in nested if not isinstance(data, dict) or data.get("type") in (None, _type_tag(m))]
        if not chosen:
            return None
        model = chosen[0]
    return model


def _model_choices(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        found.extend(_model_choices(arg))
    if hasattr(annotation, "__metadata__"):  # Annotated[...]
        found.extend(_model_choices(annotation.__origin__))
    return found


def _type_tag(model: type[BaseModel]) -> Any:
    info = model.model_fields.get("type")
    return info.default if info is not None else None

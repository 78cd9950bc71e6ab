"""Every environment name a config may use, and what builds it: the one source of names.

Reading names imports no environment (only entry-point metadata), so the config validator can ask
`unknown_name` on `--help` and `--dry-run` without importing torch or any environment's dependencies.
It lives with the config, which validates names; `tidal.envs.registry` imports and builds what a name
refers to.
"""

import re
from importlib import metadata

from tidal.errors import UserError

BUILTIN_ENVS: dict[str, str] = {
    "reverse_text": "tidal.envs.reverse_text:ReverseTextEnv",
    "alphabet_sort": "tidal.envs.alphabet_sort:AlphabetSortEnv",
    "math": "tidal.envs.math_env:MathEnv",
    "wordle": "tidal.envs.wordle:WordleEnv",
    "tool_use": "tidal.envs.tool_use:ToolUseEnv",
    "code": "tidal.envs.code_tests:CodeTestsEnv",
    "shapes": "tidal.envs.shapes:ShapesEnv",
    "search": "tidal.envs.search:SearchEnv",
    "swe": "tidal.envs.swe:SweEnv",
}
ENTRY_POINT_GROUP = "tidal.environments"
VERIFIERS_PREFIX = "vf:"
_REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def installed_envs() -> dict[str, str]:
    """Entry-point name → `module:attr` of every installed package's `tidal.environments` entry."""
    return {name: values[0] for name, values in _entry_points().items()}


def _entry_points() -> dict[str, list[str]]:
    """Entry-point name → the distinct values declared for it (one, unless two packages claim the name)."""
    found: dict[str, list[str]] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        values = found.setdefault(entry.name, [])
        if entry.value not in values:  # one distribution seen twice (installed and on the path) is one name
            values.append(entry.value)
    return found


def env_names() -> list[str]:
    """Every name that needs no prefix: the built-ins and the installed entry points."""
    return sorted({*BUILTIN_ENVS, *installed_envs()})


def _choices() -> str:
    installed = sorted(set(installed_envs()) - set(BUILTIN_ENVS))
    listed = f"built-in: {', '.join(sorted(BUILTIN_ENVS))}"
    if installed:
        listed += f"; installed: {', '.join(installed)}"
    return f"{listed}; or package.module:Class, or vf:<id>"


def unknown_name(name: str) -> str | None:
    """Why `name` names no environment, or None; imports nothing (the config validator's check)."""
    if name.startswith(VERIFIERS_PREFIX):
        return None if name[len(VERIFIERS_PREFIX) :] else "`vf:` needs a verifiers environment id after it"
    if name in BUILTIN_ENVS or _REFERENCE.match(name) or name in installed_envs():
        return None
    return f"unknown environment {name!r} ({_choices()})"


def reference(name: str) -> str:
    """The `module:attr` that environment `name` is built by (a built-in's, an entry point's, or itself)."""
    problem = unknown_name(name)
    if problem is not None:
        raise UserError(problem)
    declared = _entry_points().get(name, [])
    if name in BUILTIN_ENVS:
        if any(value != BUILTIN_ENVS[name] for value in declared):
            raise UserError(
                f"environment {name!r} is built in and also declared by an installed package "
                f"({declared[0]}); name that one by {declared[0]}"
            )
        return BUILTIN_ENVS[name]
    if len(declared) > 1:
        raise UserError(
            f"environment {name!r} is declared by several installed packages ({', '.join(declared)}); "
            "name the one you mean by module:Class"
        )
    target = declared[0] if declared else name
    if ":" not in target:
        raise UserError(f"environment {name!r}: its entry point {target!r} names no object (module:attr)")
    return target

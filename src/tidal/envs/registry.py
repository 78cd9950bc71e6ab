"""Environments by name: `load_env("wordle", seed=1)`; `vf:<id>` loads a verifiers environment.

Entries are lazy `module:Class` references so that naming an environment never imports the others.
"""

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from tidal.envs.base import Environment
from tidal.errors import UserError

if TYPE_CHECKING:
    from tidal.config.envs import EnvSpec

ENVS: dict[str, str] = {
    "reverse_text": "tidal.envs.reverse_text:ReverseTextEnv",
    "alphabet_sort": "tidal.envs.alphabet_sort:AlphabetSortEnv",
    "math": "tidal.envs.math_env:MathEnv",
    "wordle": "tidal.envs.wordle:WordleEnv",
    "tool_use": "tidal.envs.tool_use:ToolUseEnv",
    "code": "tidal.envs.code_tests:CodeTestsEnv",
}
VERIFIERS_PREFIX = "vf:"


def env_names() -> list[str]:
    return sorted(ENVS)


def load_env(name: str, **kwargs: Any) -> Environment:
    """Build environment `name` with `kwargs`; unknown names and arguments are one-line `UserError`s."""
    if name.startswith(VERIFIERS_PREFIX):
        from tidal.envs.verifiers_adapter import load_verifiers_env

        return load_verifiers_env(name[len(VERIFIERS_PREFIX) :], **kwargs)
    if name not in ENVS:
        raise UserError(f"unknown environment {name!r} (built-in: {', '.join(env_names())}; or vf:<id>)")
    module, attr = ENVS[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise UserError(f"environment {name!r}: {exc} (arguments: {_parameters(cls)})") from None
    try:
        return cls(**kwargs)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise UserError(f"environment {name!r}: {exc}") from None


def _parameters(cls: type) -> str:
    return ", ".join(inspect.signature(cls).parameters) or "none"


def build_env(spec: "EnvSpec") -> Environment:
    env = load_env(spec.name, **spec.kwargs)
    if spec.label is not None:
        env.name = spec.label  # an instance attribute: the class keeps its own name
    return env


def build_envs(specs: "list[EnvSpec]", seed: int = 0) -> Environment:
    """One environment for a run: the single one itself, or an `EnvMix` over several by weight."""
    from tidal.config.envs import check_distinct
    from tidal.envs.mix import EnvMix

    if not specs:
        raise UserError("no environment given")
    problem = check_distinct(specs)
    if problem is not None:
        raise UserError(problem)
    if len(specs) == 1:
        return build_env(specs[0])
    return EnvMix([(build_env(spec), spec.weight) for spec in specs], seed=seed)

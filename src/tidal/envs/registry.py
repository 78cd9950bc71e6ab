"""Environments by name: `load_env("wordle", seed=1)` imports and builds what a name refers to.

A name (`tidal.config.env_names`, the one source of names) is one of:
- a built-in (`reverse_text`, `math`, ...);
- an entry point that an installed package declares in the `tidal.environments` group
  (`[project.entry-points."tidal.environments"] my_env = "my_pkg.env:MyEnv"`);
- `package.module:Class`: any importable class, or factory function, that returns an `Environment`;
- `vf:<id>`: an environment written for `verifiers` (`tidal.envs.verifiers_adapter`).

`resolve_env` imports the one a name refers to and `check_env` also binds its arguments, which `tidal rl`
and `tidal eval` do before any server starts: a wrong name, a failing import or a wrong argument is one
line, not a traceback after vLLM's startup.
"""

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.config.env_names import VERIFIERS_PREFIX, reference
from tidal.envs.base import Environment
from tidal.errors import UserError, first_line

if TYPE_CHECKING:
    from tidal.config.envs import EnvSpec

EnvFactory = Callable[..., Environment]


@dataclass(frozen=True)
class Resolved:
    """What builds an environment: a class or factory, and the name to report it under in errors."""

    name: str
    factory: EnvFactory
    leading: tuple[str, ...] = ()
    """Arguments the registry passes itself before the user's (a verifiers id)."""

    def build(self, **kwargs: Any) -> Environment:
        bind_kwargs(self, kwargs)
        try:
            env = self.factory(*self.leading, **kwargs)
        except ValueError as exc:
            raise UserError(f"environment {self.name!r}: {first_line(exc)}") from None
        if not isinstance(env, Environment):
            raise UserError(
                f"environment {self.name!r}: its factory returned {type(env).__name__}, not a tidal Environment"
            )
        return env


def resolve_env(name: str) -> Resolved:
    """Import what builds environment `name`; a missing module, a module whose own import fails, a missing
    attribute or something that is not an `Environment` is a one-line `UserError`."""
    if name.startswith(VERIFIERS_PREFIX):
        from tidal.envs.verifiers_adapter import resolve_verifiers_env

        env_id = name[len(VERIFIERS_PREFIX) :]
        return Resolved(name, resolve_verifiers_env(env_id), leading=(env_id,))
    module_name, attr = reference(name).split(":")
    module = import_env_module(name, module_name)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UserError(f"environment {name!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if inspect.isclass(target):
        if not issubclass(target, Environment) or inspect.isabstract(target):
            what = "an abstract Environment" if issubclass(target, Environment) else "not a tidal Environment"
            raise UserError(
                f"environment {name!r}: {module_name}:{attr} is {what} "
                "(subclass tidal.envs.base.Environment and implement num_tasks, task and rollout)"
            )
    elif not callable(target):
        raise UserError(
            f"environment {name!r}: {module_name}:{attr} is neither an Environment class nor a factory"
        )
    return Resolved(name, target)


def import_env_module(name: str, module_name: str) -> Any:
    """`module_name` imported; not found (the module itself) and failing (its own code) are told apart."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UserError(
                f"environment {name!r}: no module named {exc.name!r} (install its package, or put it on "
                "PYTHONPATH)"
            ) from None
        raise UserError(f"environment {name!r}: importing {module_name} failed: {_described(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code may raise anything
        raise UserError(f"environment {name!r}: importing {module_name} failed: {_described(exc)}") from None


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


def bind_kwargs(resolved: Resolved, kwargs: dict[str, Any]) -> None:
    """A `UserError` naming the environment and its parameters if `kwargs` do not fit its signature."""
    try:
        signature = inspect.signature(resolved.factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call itself decide
        return
    try:
        signature.bind(*resolved.leading, **kwargs)
    except TypeError as exc:
        parameters = [p for p in signature.parameters][len(resolved.leading) :]
        raise UserError(
            f"environment {resolved.name!r}: {exc} (arguments: {', '.join(parameters) or 'none'})"
        ) from None


def load_env(name: str, **kwargs: Any) -> Environment:
    """Build environment `name` with `kwargs`; every user mistake is a one-line `UserError`."""
    return resolve_env(name).build(**kwargs)


def check_env(spec: "EnvSpec", model_name: str) -> None:
    """Everything about `spec` that can fail without building it: the name, the import, the arguments, and
    pictures for a model `model_name` that cannot train on them."""
    resolved = resolve_env(spec.name)
    bind_kwargs(resolved, dict(spec.kwargs))
    check_pictures(spec.name, model_name)


def gives_images(name: str) -> bool:
    """Whether environment `name`'s prompts carry pictures (its class says `gives_images = True`), without
    building it."""
    return getattr(resolve_env(name).factory, "gives_images", False) is True


def check_pictures(name: str, model_name: str) -> None:
    """A one-line `UserError` for an environment whose prompts carry pictures, where the model cannot train
    on them (no vision tower: a text template would drop them silently; or a vision-language model type
    tidal does not train yet)."""
    if not gives_images(name):
        return
    from tidal.models.vision import training_problem

    problem = training_problem(model_name)
    if problem is not None:
        raise UserError(f"environment {name!r} gives images, but {problem}")


def check_envs(named: "list[tuple[str, EnvSpec]]", model_name: str) -> None:
    """`check_env` of each (config key, spec); the first problem is a `UserError` naming its key."""
    for key, spec in named:
        try:
            check_env(spec, model_name)
        except UserError as exc:
            hint = ""
            if "online_eval.env" in key and "unexpected keyword argument 'seed'" in str(exc):
                hint = (
                    " (online eval draws held-out tasks with the training seed + an offset: give the "
                    "environment a `seed` argument, or set [[orchestrator.online_eval.env]])"
                )
            raise UserError(f"{key}: {exc}{hint}") from None


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

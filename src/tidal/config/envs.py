"""Schema of the environments a run draws tasks from: `[[orchestrator.env]]` / `[[env]]` tables with weights."""

from typing import Any

from pydantic import Field, field_validator

from tidal.config.base import Config

BUILTIN_ENVS = ("reverse_text", "alphabet_sort", "math", "wordle", "tool_use", "code")


class EnvSpec(Config):
    """One environment and its share of the tasks."""

    name: str
    """Built-in environment (reverse_text, alphabet_sort, math, wordle, tool_use, code) or `vf:<id>` for a verifiers one."""
    weight: float = Field(default=1.0, gt=0)
    """Sampling weight: tasks are drawn from the environments in proportion to their weights."""
    kwargs: dict[str, Any] = {}
    """Arguments of the environment's constructor, e.g. {num_examples = 5000, seed = 1}."""
    label: str | None = None
    """Name reported in metrics (default: `name`); needed when one environment appears twice."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in BUILTIN_ENVS and not name.startswith("vf:"):
            raise ValueError(
                f"unknown environment {name!r} (built-in: {', '.join(BUILTIN_ENVS)}; or vf:<id>)"
            )
        return name

    @property
    def display_name(self) -> str:
        return self.label or self.name


def check_distinct(specs: list[EnvSpec]) -> str | None:
    """Why a list of specs cannot be mixed (two with the same reported name), or None."""
    names = [s.display_name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        return f"environment(s) {', '.join(duplicates)} appear twice; give each a distinct `label`"
    return None

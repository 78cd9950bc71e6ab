"""Schema of the environments a run draws tasks from: `[[orchestrator.env]]` / `[[env]]` tables with weights."""

from typing import Any

from pydantic import Field, field_validator

from tidal.config.base import Config


class EnvSpec(Config):
    """One environment and its share of the tasks."""

    name: str
    """A built-in environment (reverse_text, alphabet_sort, math, wordle, tool_use, code), one an installed package
    declares (entry point group `tidal.environments`), `package.module:Class` (any importable Environment
    class or factory) or `vf:<id>` for a verifiers one (docs/environments.md)."""
    weight: float = Field(default=1.0, gt=0)
    """Sampling weight: tasks are drawn from the environments in proportion to their weights."""
    kwargs: dict[str, Any] = {}
    """Arguments of the environment's constructor, e.g. {num_examples = 5000, seed = 1}."""
    label: str | None = None
    """Name reported in metrics (default: `name`); needed when one environment appears twice."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from tidal.config.env_names import unknown_name  # imports no environment (nor torch)

        problem = unknown_name(name)
        if problem is not None:
            raise ValueError(problem)
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

"""Base class of every config node: unknown keys are errors and attribute docstrings become `--help` text."""

from pydantic import BaseModel, ConfigDict


class Config(BaseModel):
    """A strict config node: unknown keys fail validation, defaults are validated too."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        validate_assignment=True,
    )


class ConfigProblem(ValueError):
    """An inconsistent combination of fields, raised from validators with the key path that is wrong.

    `key` is relative to the model whose validator raised it; the loader joins it to that model's location.
    """

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key

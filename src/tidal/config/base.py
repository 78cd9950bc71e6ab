"""Base class of every config node: unknown keys are errors and attribute docstrings become `--help` text."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Discriminator


class Config(BaseModel):
    """A strict config node: unknown keys fail validation, defaults are validated too."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        validate_assignment=True,
    )

    UNKNOWN_KEY_HINTS: ClassVar[dict[str, str]] = {}
    """Why a key that is not a field is unknown here, by key (e.g. it belongs to another command's table):
    said instead of a spelling suggestion, which would point at the wrong key."""

    SET_ELSEWHERE: ClassVar[dict[tuple[str, ...], str]] = {}
    """Keys of a command's config that the command sets itself (and refuses when written), by key path, with
    where to set them instead: `--help` leaves them out."""

    HELP_MAIN: ClassVar[tuple[str, ...] | None] = None
    """Dotted keys (or tables) that `--help` shows; `--help-all` shows every key. None: `--help` shows all."""


def type_or(default: str, *others: str) -> Discriminator:
    """A union's discriminator that reads `type` and falls back to `default` when it is not written, so
    `--trainer.publish.keep-last 5` alone keeps the default variant instead of failing to pick one."""

    def tag(value: Any) -> str:
        found = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return str(found)

    choices = " or ".join(repr(t) for t in (default, *others))
    return Discriminator(
        tag, custom_error_type="unknown_type", custom_error_message=f"`type` must be {choices}"
    )


class ConfigProblem(ValueError):
    """An inconsistent combination of fields, raised from validators with the key path that is wrong.

    `key` is relative to the model whose validator raised it; the loader joins it to that model's location.
    `also`: the other keys (relative the same way) whose values make `key` wrong; the error is blamed on
    where the latest-set of them came from (a flag beats a file: `--max-steps 40`, not the file's
    ckpt.interval).
    """

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.also = also


def shadowed_key(config: Config, table: dict[tuple[str, ...], str]) -> tuple[str, str] | None:
    """The first (dotted key, where to set it instead) of `table` that the user set in `config`; None if none.

    "Set" means written in the file or on the command line (pydantic's `model_fields_set`), not a default.
    """
    for path, top in table.items():
        node: object = config
        for part in path:
            if not isinstance(node, Config) or part not in node.model_fields_set:
                break
            node = getattr(node, part)
        else:
            return ".".join(path), top
    return None

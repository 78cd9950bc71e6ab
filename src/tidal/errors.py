"""User-facing errors: the CLI prints them as one line and exits non-zero, without a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, data, environment) that they can fix.

    `exit_code` 2 is used for configuration errors found before anything starts, 1 for the rest.
    """

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The inference client's errors (tidal.inference.client), shared by its server pool, weight fan-out and
generation client."""

import asyncio


class InferenceError(Exception):
    """Base of the client's errors."""


class RequestRejected(InferenceError):
    """The server refused the request (4xx): fix the request, retrying will not help."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.status = status
        self.message = message


class ServerFailed(InferenceError):
    """A server error (5xx) or transport failure that persisted through every retry."""


class NoHealthyServer(InferenceError):
    """Every server is out of rotation."""


class RoutesMissing(ServerFailed):
    """Routing replay asked for the experts the model routed each token to, and an answer lacks them (a
    server without `--enable-return-routed-experts`, or routes that do not cover the tokens)."""


def is_infrastructure_error(exc: BaseException) -> bool:
    """Inference unreachable (or the work cancelled): not an environment's failure, so it must stop the
    run rather than be counted as one failed rollout."""
    return isinstance(exc, NoHealthyServer | ServerFailed | asyncio.CancelledError)

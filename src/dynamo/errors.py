"""Errors that reach the user.

Anything derived from :class:`UserError` is the user's to fix (a bad flag, a missing file, a malformed
request); the CLI prints it as one line without a traceback, the HTTP service turns it into an
OpenAI-shaped 4xx.  Anything else is our bug and is reported as such.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave us; its message is shown as-is, on one line."""


class ModelError(UserError):
    """The model argument cannot be used (missing files, corrupt weights, unsupported architecture)."""


class RequestError(UserError):
    """A request that cannot be served as sent.

    ``status`` is the HTTP status it maps to; ``param`` names the offending field where known, as the
    OpenAI API does.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _default_type(status)


class ServiceUnavailableError(RequestError):
    """A 503 whose ``Retry-After`` header (``retry_after`` seconds) tells the client when to try again:
    every worker is at its limit and the wait queue is full or the wait ran out, too many requests are
    in progress on the frontend, or the workers cannot be reached (NATS down)."""

    def __init__(self, message: str, *, retry_after: int = 1, overload: bool = False) -> None:
        super().__init__(message, status=503)
        self.retry_after = retry_after
        self.overload = overload  # every worker busy / frontend at its limit (counted as a rejection)


class EngineError(Exception):
    """The engine failed while producing a response (not the user's fault): a 500, or an error event."""


def _default_type(status: int) -> str:
    """The OpenAI API's error types: every 4xx is an ``invalid_request_error``."""
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"

"""Error responses: OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` everywhere but
under ``/v1/messages``, which answers in Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

:func:`error_middleware` is the one place an exception becomes a response: a route raises
(:class:`RequestError` and its 503 with ``Retry-After``, :class:`EngineError`, aiohttp's own 404/405/413)
and the client gets the JSON error with the right status, in the shape of the API it called; a bug of
ours is logged in full and answered as a clean 500.

Anthropic's statuses differ in one place: a server too busy to take the request is a 529
``overloaded_error`` (its SDKs retry it, honouring ``Retry-After``), where OpenAI clients get a 503.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import orjson
from aiohttp import web

from dynamo.errors import EngineError, RequestError, ServiceUnavailableError
from dynamo.frontend.http.body import too_large

log = logging.getLogger(__name__)


def error_body(message: str, status: int, *, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> bytes:
    err = RequestError(message, status=status, param=param, type=type)
    return orjson.dumps(
        {"error": {"message": message, "type": err.type, "param": param, "code": code if code is not None else status}}
    )


def error_response(message: str, status: int, **kw: object) -> web.Response:
    return web.Response(body=error_body(message, status, **kw), status=status, content_type="application/json")  # type: ignore[arg-type]


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_OVERLOADED = 529  # Anthropic's status for "overloaded", retried by its clients
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    ANTHROPIC_OVERLOADED: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is under Anthropic's Messages API (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(message: str, status: int) -> bytes:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_error_response(message: str, status: int) -> web.Response:
    return web.Response(body=anthropic_error_body(message, status), status=status, content_type="application/json")


def anthropic_status(e: RequestError) -> int:
    """The status Anthropic's API gives for ``e``: 529 for a server too busy, else ``e``'s own."""
    return ANTHROPIC_OVERLOADED if isinstance(e, ServiceUnavailableError) and e.overload else e.status


def request_error_response(e: RequestError, anthropic: bool = False) -> web.Response:
    if anthropic:
        resp = anthropic_error_response(e.message, anthropic_status(e))
    else:
        resp = error_response(e.message, e.status, type=e.type, param=e.param, code=e.code)
    retry_after = getattr(e, "retry_after", None)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(retry_after)
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    anthropic = is_anthropic_path(request.path)
    respond: Callable[[str, int], web.Response] = anthropic_error_response if anthropic else error_response
    try:
        return await handler(request)
    except RequestError as e:
        return request_error_response(e, anthropic)
    except web.HTTPException as e:
        if e.status == 404:
            return respond(f"Not found: {request.method} {request.path}", 404)
        if e.status == 405:
            return respond(f"Method {request.method} not allowed for {request.path}", 405)
        if e.status == 413:
            return respond(too_large(request), 413)
        return respond(e.reason or "HTTP error", e.status)
    except EngineError as e:
        log.error("engine error: %s", e)
        return respond(f"Failed to generate completions: {e}", 500)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # our bug: log it fully, answer cleanly
        log.exception("internal error handling %s %s", request.method, request.path)
        return respond(f"Internal server error: {type(e).__name__}: {e}", 500)

"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}`` for every error.

:func:`error_middleware` is the one place an exception becomes a response: a route raises
(:class:`RequestError` and its 503 with ``Retry-After``, :class:`EngineError`, aiohttp's own 404/405/413)
and the client gets the JSON error with the right status; a bug of ours is logged in full and answered
as a clean 500.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import orjson
from aiohttp import web

from dynamo.errors import EngineError, RequestError
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


def request_error_response(e: RequestError) -> web.Response:
    resp = error_response(e.message, e.status, type=e.type, param=e.param, code=e.code)
    retry_after = getattr(e, "retry_after", None)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(retry_after)
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return request_error_response(e)
    except web.HTTPException as e:
        if e.status == 404:
            return error_response(f"Not found: {request.method} {request.path}", 404)
        if e.status == 405:
            return error_response(f"Method {request.method} not allowed for {request.path}", 405)
        if e.status == 413:
            return error_response(too_large(request), 413)
        return error_response(e.reason or "HTTP error", e.status)
    except EngineError as e:
        log.error("engine error: %s", e)
        return error_response(f"Failed to generate completions: {e}", 500)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # our bug: log it fully, answer cleanly
        log.exception("internal error handling %s %s", request.method, request.path)
        return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)

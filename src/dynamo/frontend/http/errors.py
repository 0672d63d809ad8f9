"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}`` for every error."""

from __future__ import annotations

import orjson
from aiohttp import web

from dynamo.errors import RequestError


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

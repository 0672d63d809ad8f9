"""Request and response bodies of the HTTP routes: JSON in, JSON out, and the client's request id.

Every route reads its body through :func:`read_json`, so a body over the limit is a 413, a body that
is not JSON a 400 (a 415 when the client said it sent something else), all with the same messages.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from dynamo.errors import RequestError

BODY_LIMIT_KEY = web.AppKey("dynamo_body_limit", int)  # the app's body limit in bytes (options.py's)


def too_large(request: web.Request) -> str:
    """The 413's message."""
    return f"Request body too large (limit {request.app[BODY_LIMIT_KEY]} bytes)"


async def read_json(request: web.Request) -> Any:
    """The request's body, decoded; a :class:`RequestError` (413, 415 or 400) when it cannot be."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(too_large(request), status=413) from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        ctype = request.content_type
        if body and ctype not in ("application/json", "application/octet-stream", "") and "json" not in ctype:
            raise RequestError(
                f"Expected request with `Content-Type: application/json` (got {ctype})", status=415
            ) from None
        raise RequestError(f"Failed to parse the request body as JSON: {e}") from None


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def request_id(request: web.Request) -> str | None:
    """The client's ``x-dynamo-request-id`` (or ``x-request-id``) when it is a sane id, else None (one is made)."""
    rid = request.headers.get("x-dynamo-request-id") or request.headers.get("x-request-id")
    if rid and 0 < len(rid) <= 128 and rid.replace("-", "").replace("_", "").isalnum():
        return rid
    return None

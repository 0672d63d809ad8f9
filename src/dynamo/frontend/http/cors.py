"""CORS for browsers calling the API from another origin (``--allowed-origins``; none by default).

A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered here, before
the API key check: browsers never send credentials on a preflight.  It gets 204 with the allowed
methods of that path and the requested headers when the origin is allowed, a 403 when it is not, and
the usual 404 for a path that does not exist.  Every other response to an allowed origin carries
``Access-Control-Allow-Origin``; the header is added when the response is prepared, so streamed
responses get it too.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web

from dynamo.frontend.http.errors import error_response

PREFLIGHT_MAX_AGE_S = 600
# what the SDKs send; a preflight asking for others gets them echoed back (we read no custom headers)
DEFAULT_ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Dynamo-Request-Id"


class OriginPolicy:
    def __init__(self, origins: list[str]):
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin.rstrip("/") in self.origins

    def allow_origin_value(self, origin: str) -> str:
        return "*" if self.any else origin


def cors_middleware(origins: list[str]) -> Callable[..., Any]:
    policy = OriginPolicy(origins)

    @web.middleware
    async def cors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        wanted = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or wanted is None:
            return await handler(request)
        # a preflight: which methods does this path take?
        exc = request.match_info.http_exception
        if isinstance(exc, web.HTTPMethodNotAllowed):
            methods = sorted(m for m in exc.allowed_methods if m != "HEAD")
        elif exc is None:
            methods = [request.method]
        else:
            return error_response(f"Not found: {request.path}", 404)
        if not policy.allows(origin):
            return error_response(f"Origin {origin} is not allowed (see --allowed-origins)", 403)
        if wanted.upper() not in methods:
            return error_response(f"Method {wanted} not allowed for {request.path}", 405)
        headers = {
            "Access-Control-Allow-Origin": policy.allow_origin_value(origin),
            "Access-Control-Allow-Methods": ", ".join(methods + ["OPTIONS"]),
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers")
            or DEFAULT_ALLOW_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin",
        }
        return web.Response(status=204, headers=headers)

    return cors


def add_cors_headers(origins: list[str]) -> Callable[[web.Request, web.StreamResponse], Any]:
    """An ``on_response_prepare`` hook: the allow-origin header on responses to allowed origins."""
    policy = OriginPolicy(origins)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        if policy.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = policy.allow_origin_value(origin)
        if not policy.any:
            response.headers["Vary"] = "Origin"

    return on_prepare

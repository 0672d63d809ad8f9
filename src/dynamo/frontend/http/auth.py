"""API keys: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients send it) on
every route but the operational ones.  Under ``/v1/messages`` the 401 takes Anthropic's error shape.

The presented key is compared with every configured key in constant time (hashes of equal length, all
keys tried whatever the outcome), so neither the match nor its position nor the key's length shows in
the response time.  Keys are never logged, and the 401 does not echo what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any, Callable

from aiohttp import web

from dynamo.frontend.http.errors import anthropic_error_response, error_response, is_anthropic_path

log = logging.getLogger(__name__)

# what load balancers and Prometheus poll: open, as in vLLM and Dynamo
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyChecker:
    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]

    def allows(self, presented: str) -> bool:
        got = _digest(presented)
        ok = False
        for want in self._digests:
            ok |= hmac.compare_digest(got, want)
        return ok


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def unauthorized(message: str, anthropic: bool = False) -> web.Response:
    if anthropic:
        resp = anthropic_error_response(message, 401)
    else:
        resp = error_response(message, 401, type="invalid_request_error", code="invalid_api_key")
    resp.headers["WWW-Authenticate"] = 'Bearer realm="dynamo"'
    return resp


def api_key_middleware(keys: list[str]) -> Callable[..., Any]:
    checker = KeyChecker(keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization")) or request.headers.get("x-api-key") or None
        anthropic = is_anthropic_path(request.path)
        if token is None:
            return unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>'.", anthropic)
        if not checker.allows(token):
            log.info("rejected %s %s from %s: wrong API key", request.method, request.path, request.remote)
            return unauthorized("Incorrect API key provided.", anthropic)
        return await handler(request)

    return check_api_key

"""The routes beyond chat and completions, each in its own module, registered on the service's app.

``/v1/embeddings`` (embeddings.py), ``/v1/responses`` and ``/v1/responses/{id}`` (responses.py), ``/tokenize`` and ``/detokenize``
(tokenize.py).  They share the service's model manager, metrics and in-flight bookkeeping; the two that
run an engine count against the frontend-wide ``--max-inflight`` like chat and completions do.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def register_api_routes(service: Any) -> None:
    from dynamo.frontend.http.embeddings import EmbeddingsRoute
    from dynamo.frontend.http.responses import ResponsesRoute
    from dynamo.frontend.http.tokenize import TokenizeRoutes

    router = service.app.router
    tokenize = TokenizeRoutes(service.models)
    router.add_post("/tokenize", tokenize.tokenize)
    router.add_post("/detokenize", tokenize.detokenize)
    router.add_post("/v1/embeddings", admitted(service, EmbeddingsRoute(service).handle))
    responses = ResponsesRoute(service)
    router.add_post("/v1/responses", admitted(service, responses.handle))
    router.add_get("/v1/responses/{response_id}", responses.retrieve)
    router.add_get("/v1/responses/{response_id}/input_items", responses.list_input_items)
    router.add_delete("/v1/responses/{response_id}", responses.delete)


def admitted(service: Any, handler: Handler) -> Handler:
    """``handler`` behind the service's frontend-wide limit (a 503 with Retry-After past it), when it has one."""
    if not hasattr(service, "max_inflight"):
        return handler

    async def admit(request: web.Request) -> web.StreamResponse:
        from dynamo.errors import ServiceUnavailableError

        if service._admitted >= service.max_inflight:
            raise ServiceUnavailableError(
                f"Too many requests in progress (limit {service.max_inflight}); try again shortly")
        service._admitted += 1
        try:
            return await handler(request)
        finally:
            service._admitted -= 1

    return admit

"""The routes beyond chat and completions, each in its own module, registered on the service's app.

``/v1/embeddings`` (embeddings.py), ``/v1/responses`` (responses.py), ``/tokenize`` and ``/detokenize``
(tokenize.py).  They share the service's model manager, metrics and in-flight bookkeeping.
"""

from __future__ import annotations

from typing import Any


def register_api_routes(service: Any) -> None:
    from dynamo.llm.http.embeddings import EmbeddingsRoute
    from dynamo.llm.http.responses import ResponsesRoute
    from dynamo.llm.http.tokenize import TokenizeRoutes

    router = service.app.router
    tokenize = TokenizeRoutes(service.models)
    router.add_post("/tokenize", tokenize.tokenize)
    router.add_post("/detokenize", tokenize.detokenize)
    router.add_post("/v1/embeddings", EmbeddingsRoute(service).handle)
    router.add_post("/v1/responses", ResponsesRoute(service).handle)

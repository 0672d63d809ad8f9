"""The HTTP server span of every generating route (chat, completions, responses, messages, embeddings).

Why one wrapper for all routes, outside the admission gate: a request refused at the gate (503) is
traced too, and each route gets the same span without code of its own.  The span's parent is the
client's W3C ``traceparent``; it is current in the handler's task, so the request's log lines carry its
ids and what the handler starts without a parent (the request-plane call of an embedding) is its child.
Once a route knows its model it binds the span to the request's context (:func:`bind`, called by the
admission's ``run``): pre-processing, routing and the workers' spans hang under it, and the usage the
pipeline counted is written on it when the request ends (:func:`record_usage`).

Attributes follow OpenTelemetry's GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.usage.*``).  With tracing off the
wrapper is not installed at all (service.py checks the flag once, at start-up).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from dynamo.errors import RequestError
from dynamo.llm.engine import Context
from dynamo.runtime import tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# the GenAI operation of each generating route (its endpoint label in the metrics)
OPERATIONS = {"chat_completions": "chat", "completions": "text_completion", "responses": "chat",
              "messages": "chat", "embeddings": "embeddings"}


def traced(endpoint: str, handler: Handler) -> Handler:
    """``handler`` inside a server span named ``METHOD /path``; ``handler`` itself when tracing is off."""
    if not tracing.ENABLED:
        return handler
    operation = OPERATIONS[endpoint]

    async def serve(request: web.Request) -> web.StreamResponse:
        span = tracing.start_remote_child(f"{request.method} {request.path}", request.headers, attributes={
            "http.request.method": request.method, "url.path": request.path,
            "gen_ai.operation.name": operation})
        token = tracing.attach(span)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except (web.HTTPException, RequestError) as exc:
            status = exc.status
            raise
        finally:
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 400:
                    tracing.fail(span, f"HTTP {status}")
                span.end()
            tracing.detach(token)

    return serve


def bind(ctx: Context, model: str, max_tokens: int | None) -> None:
    """The request's model is known: its server span (this task's current one) becomes the context's
    trace, the parent of the engine's spans, and says the model, the request id and the token budget."""
    span = tracing.current()
    if span is None:
        return
    ctx.trace = span
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("dynamo.request_id", ctx.id)
    if max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", max_tokens)


def record_usage(ctx: Context) -> None:
    """The tokens the request used, on its server span (it ends when the handler returns)."""
    span = ctx.trace
    if span is None:
        return
    span.set_attribute("gen_ai.usage.input_tokens", ctx.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", ctx.completion_tokens)
    if ctx.cached_tokens is not None:
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", ctx.cached_tokens)

"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request flow for both.

Validate (parse the JSON body into the typed request) -> find the model -> start its pipeline -> stream
the chunks as SSE (sse.py) or fold them into one response (``llm/aggregate.py``).  A client that
disconnects cancels the handler (``handler_cancellation``), which kills the request's context and so
stops the engine's work.  Both routes sit behind the frontend-wide limit (admission.py).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from dynamo.errors import RequestError
from dynamo.frontend.http.admission import Admission
from dynamo.frontend.http.body import json_response, read_json, request_id
from dynamo.frontend.http.metrics import RequestMetrics
from dynamo.frontend.http.sse import stream_sse
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm import first_token
from dynamo.llm.aggregate import fold_chat, fold_completion
from dynamo.llm.chunks import opening_chunks, split_opening
from dynamo.llm.engine import Context
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    max_tokens_of,
    parse_chat_request,
    parse_completion_request,
)
from dynamo.runtime import tracing


class ChatRoutes:
    def __init__(self, models: ModelManager, admission: Admission):
        self.models = models
        self.admission = admission

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions", parse_chat_request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", parse_completion_request)

    async def _generate(self, request: web.Request, endpoint: str, parse: Callable[[Any], Any]) -> web.StreamResponse:
        if not tracing.ENABLED:
            return await self._generate_one(request, endpoint, parse, None)
        # the request's server span: the client's traceparent is its parent; current in this task, so the
        # request's log lines carry its ids
        span = tracing.start_remote_child(f"{request.method} {request.path}", request.headers, attributes={
            "http.request.method": request.method, "url.path": request.path,
            "gen_ai.operation.name": "chat" if endpoint == "chat_completions" else "text_completion"})
        token = tracing.attach(span)
        status = 500
        try:
            resp = await self._generate_one(request, endpoint, parse, span)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except RequestError as exc:
            status = exc.status
            raise
        finally:
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 400:
                    tracing.fail(span, f"HTTP {status}")
                span.end()
            tracing.detach(token)

    async def _generate_one(self, request: web.Request, endpoint: str, parse: Callable[[Any], Any],
                            span: tracing.Span | None) -> web.StreamResponse:
        t_in = time.perf_counter()
        raw = await read_json(request)
        req = parse(raw)
        model = self.models.get(req.model)
        streaming = bool(req.stream)
        ctx = Context(request_id(request))
        if span is not None:
            ctx.trace = span
            span.set_attribute("gen_ai.request.model", req.model)
            span.set_attribute("dynamo.request_id", ctx.id)
            max_tokens = max_tokens_of(req)
            if max_tokens is not None:
                span.set_attribute("gen_ai.request.max_tokens", max_tokens)
        try:
            return await self._answer(request, endpoint, req, raw, model, streaming, ctx, t_in)
        finally:
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", ctx.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", ctx.completion_tokens)
                if ctx.cached_tokens is not None:
                    span.set_attribute("gen_ai.usage.cache_read.input_tokens", ctx.cached_tokens)

    async def _answer(self, request: web.Request, endpoint: str, req: Any, raw: Any, model: Any, streaming: bool,
                      ctx: Context, t_in: float) -> web.StreamResponse:
        first_token.begin(ctx, t_in)
        with self.admission.run(request, ctx, req.model, endpoint, streaming) as flight:
            chat = isinstance(req, ChatCompletionRequest)
            stream = model.chat(req, raw, ctx) if chat else model.completions(req, raw, ctx)
            if streaming:
                split = None
                if chat:  # the role goes in an opening chunk of its own, as OpenAI and vLLM send it
                    n = req.n or 1
                    if n > 1 or (req.nvext is not None and req.nvext.annotations):
                        stream = opening_chunks(stream, n)
                    else:
                        split = split_opening
                resp, flight.ok = await stream_sse(request, stream, ctx, flight.metrics, split_first=split)
                return resp
            stream = _metered(stream, ctx, flight.metrics)
            fold = fold_chat if chat else fold_completion
            try:
                body = await fold(stream, ctx, req.model)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            resp = json_response(body)
            first_token.report(ctx, "answer")
            flight.ok = True
            return resp


async def _metered(stream: AsyncIterator[Any], ctx: Context, rm: RequestMetrics) -> AsyncIterator[Any]:
    try:
        async for item in stream:
            rm.tokens(ctx.completion_tokens, ctx.prompt_tokens)
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]

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


class ChatRoutes:
    def __init__(self, models: ModelManager, admission: Admission):
        self.models = models
        self.admission = admission

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions", parse_chat_request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", parse_completion_request)

    async def _generate(self, request: web.Request, endpoint: str, parse: Callable[[Any], Any]) -> web.StreamResponse:
        t_in = time.perf_counter()
        raw = await read_json(request)
        req = parse(raw)
        model = self.models.get(req.model)
        ctx = Context(request_id(request))
        return await self._answer(request, endpoint, req, raw, model, bool(req.stream), ctx, t_in)

    async def _answer(self, request: web.Request, endpoint: str, req: Any, raw: Any, model: Any, streaming: bool,
                      ctx: Context, t_in: float) -> web.StreamResponse:
        first_token.begin(ctx, t_in)
        with self.admission.run(request, ctx, req.model, endpoint, streaming, max_tokens_of(req)) as flight:
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
            rm.tokens(ctx.completion_tokens, ctx.prompt_tokens, ctx.cached_tokens)
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]

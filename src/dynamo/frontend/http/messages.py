"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on the chat pipeline.

The request becomes a chat completion (``llm/protocols/anthropic.py``) and runs through the model's
``chat`` stream like any other, behind the same admission gate, so the template, the tool-call parsers
and the reasoning parsers are the chat route's; the chunks become content blocks
(``messages_output.py``), folded into one message or streamed as Anthropic's events through the one SSE
writer.  Errors take Anthropic's shape (errors.py does it for every path under ``/v1/messages``); the
``x-api-key`` header is taken as well as ``Authorization`` (auth.py); ``anthropic-version`` and
``anthropic-beta`` are accepted and need nothing; every answer carries a ``request-id`` header.

``count_tokens`` renders the chat template and tokenizes exactly as the request would be (the count
is the prompt the engine would see), for models whose template and tokenizer are on this server.

The routes are served when ``--enable-anthropic-api`` (or ``DYN_ENABLE_ANTHROPIC_API``) is given, as
in Dynamo; without it they answer a 404 that says so.
"""

from __future__ import annotations

import time

from aiohttp import web

from dynamo.errors import RequestError
from dynamo.frontend.http.admission import Admission
from dynamo.frontend.http.body import json_response, read_json, request_id
from dynamo.frontend.http.messages_output import MessageBuilder
from dynamo.frontend.http.sse import stream_sse
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm import first_token
from dynamo.llm.engine import Context
from dynamo.llm.pipeline import CorePipeline
from dynamo.llm.protocols.anthropic import (
    chat_request,
    parse_count_tokens_request,
    parse_messages_request,
    thinking_omitted,
)
from dynamo.llm.protocols.openai import parse_chat_request

ENABLE_FLAG = "--enable-anthropic-api"


class MessagesRoutes:
    def __init__(self, models: ModelManager, admission: Admission):
        self.models = models
        self.admission = admission

    async def create(self, request: web.Request) -> web.StreamResponse:
        t_in = time.perf_counter()
        raw = await read_json(request)
        req = parse_messages_request(raw)
        model = self.models.get(req.model)
        chat_raw = chat_request(req)
        chat_req = parse_chat_request(chat_raw)
        ctx = Context(request_id(request))
        headers = {"request-id": "req_" + ctx.id.replace("-", "")}
        first_token.begin(ctx, t_in)
        streaming = bool(req.stream)
        with self.admission.run(request, ctx, req.model, "messages", streaming, req.max_tokens) as flight:
            builder = MessageBuilder(req.model, ctx, thinking_omitted(req))
            stream = model.chat(chat_req, chat_raw, ctx)
            if streaming:
                resp, flight.ok = await stream_sse(request, stream, ctx, flight.metrics, builder, headers)
                return resp
            try:
                async for chunk in stream:
                    flight.metrics.tokens(ctx.completion_tokens, ctx.prompt_tokens, ctx.cached_tokens)
                    builder.feed(chunk)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            resp = json_response(builder.message())
            resp.headers.update(headers)
            first_token.report(ctx, "answer")
            flight.ok = True
            return resp

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        raw = await read_json(request)
        req = parse_count_tokens_request(raw)
        model = self.models.get(req.model)
        if not isinstance(model, CorePipeline) or model.tokenizer is None:
            raise RequestError(f"The model '{req.model}' is served by an engine that templates and tokenizes "
                               "by itself: its tokens cannot be counted here", param="model")
        chat_raw = chat_request(req)
        rendered = model.preprocessor.render_chat(parse_chat_request(chat_raw), chat_raw)
        if rendered.images:  # each image counts the positions it takes (loaded and checked as for a message)
            ids, _ = await model.preprocessor.image_prompt(rendered)
        else:
            ids = await model.tokenizer.encode_prompt_async(rendered.prompt)  # long prompts: in a thread
        return json_response({"input_tokens": len(ids)})


async def messages_disabled(request: web.Request) -> web.StreamResponse:
    """What ``/v1/messages`` answers when the Anthropic API was not enabled."""
    raise RequestError(f"The Anthropic Messages API is not enabled on this server: start it with {ENABLE_FLAG} "
                       "(or DYN_ENABLE_ANTHROPIC_API=1)", status=404)

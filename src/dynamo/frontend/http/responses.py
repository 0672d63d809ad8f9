"""``/v1/responses``: the Responses API on top of the chat pipeline.

The request becomes a chat completion (see ``protocols/responses.py``: messages, function tools and
the items of an agent loop), runs through the model's ``chat`` stream like any other, and the deltas
become output items (``responses_output.py``: reasoning, message, function calls), folded into a
``response`` object or streamed as the documented events: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` ... ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it short), each
with a ``sequence_number``.

Responses live in a bounded in-memory store, ``DYN_RESPONSES_STORE_SIZE`` entries (default 1000, least
recently used evicted first; ``store: false`` keeps one out): ``GET /v1/responses/{id}`` returns one,
``GET /v1/responses/{id}/input_items`` its input, ``DELETE`` forgets it, and ``previous_response_id``
continues its conversation (the turns up to and including its answer, without its ``instructions``, as
the API defines).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator

import orjson
from aiohttp import web

from dynamo.errors import RequestError
from dynamo.frontend.http.admission import Admission
from dynamo.frontend.http.body import json_response, read_json
from dynamo.frontend.http.metrics import RequestMetrics
from dynamo.frontend.http.responses_output import Event, OutputItems
from dynamo.frontend.http.responses_store import ResponseStore, Stored, store_mb_from_env, store_size_from_env
from dynamo.frontend.http.sse import line_safe, stream_sse
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context
from dynamo.llm.protocols.openai import parse_chat_request
from dynamo.llm.protocols.responses import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    input_items,
    input_messages,
    parse_responses_request,
)


class _Run:
    """One response being produced: its id, its output items so far, and the response object's shape.

    It is also the stream's SSE format (sse.py's ``SseFormat``): the typed events with their
    ``sequence_number``, ``response.created`` and ``response.in_progress`` first, the output items' events
    per delta, and ``response.completed`` (or ``incomplete``) or an ``error`` event at the end.
    """

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.out = OutputItems()
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.seq = 0

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str) -> dict[str, Any]:
        req = self.req
        done = status in ("completed", "incomplete")
        usage = None
        if done:
            u = self.usage or {}
            pt, ct = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
            usage = {"input_tokens": pt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": ct,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": pt + ct}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": req.model, "output": self.out.output() if done else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "metadata": req.metadata or {}, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "max_tool_calls": req.max_tool_calls,
            "text": {"format": {"type": "text"}}, "reasoning": None, "background": False,
            "usage": usage,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + line_safe(orjson.dumps(body)) + b"\n\n"

    def events(self, events: list[Event]) -> bytes:
        return b"".join(self.event(kind, **fields) for kind, fields in events)

    # -- as the stream's SSE format
    def begin(self) -> list[bytes]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def item(self, delta: dict[str, Any]) -> bytes:
        return self.events(self.out.feed(delta))

    def end(self) -> bytes:
        status = self.status
        return self.events(self.out.finish(status)) + self.event(f"response.{status}", response=self.response(status))

    def failed(self, message: str, status: int) -> bytes:
        return self.event("error", code=str(status), message=message, param=None)


class ResponsesRoute:
    def __init__(self, models: ModelManager, admission: Admission):
        self.models = models
        self.admission = admission
        self.store = ResponseStore(store_size_from_env(), store_mb_from_env())

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}``: a stored response as it was returned."""
        if request.query.get("stream") not in (None, "false"):
            raise RequestError("Streaming a stored response is for background responses, which are not "
                               "supported", param="stream")
        return json_response(self._stored(request).response)

    async def delete(self, request: web.Request) -> web.StreamResponse:
        """``DELETE /v1/responses/{id}``: forget a stored response."""
        stored = self._stored(request)
        self.store.delete(stored.response["id"])
        return json_response({"id": stored.response["id"], "object": "response", "deleted": True})

    async def list_input_items(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}/input_items``: the request's input items, paginated as the API does
        (``limit`` 1-100, default 20; ``order`` ``desc`` (default) or ``asc``; ``after`` an item id)."""
        stored = self._stored(request)
        q = request.query
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise RequestError("limit must be a whole number from 1 to 100", param="limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError("order must be 'asc' or 'desc'", param="order")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        after = q.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise RequestError(f"No input item with id '{after}' in this response", status=404, param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    def _stored(self, request: web.Request) -> Stored:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise RequestError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
        return stored

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await read_json(request)
        req = parse_responses_request(raw)
        model = self.models.get(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise RequestError(f"Previous response with id '{req.previous_response_id}' not found.",
                                   status=404, param="previous_response_id")
            history = list(prev.conversation)
        conversation = history + input_messages(req)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        chat_raw: dict[str, Any] = {"model": req.model, "messages": messages, "stream": True,
                                    "stream_options": {"include_usage": True}}
        tools = chat_tools(req)
        if tools:
            chat_raw["tools"] = tools
        tool_choice = chat_tool_choice(req)
        if tool_choice is not None:
            chat_raw["tool_choice"] = tool_choice
        for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user"), ("parallel_tool_calls", "parallel_tool_calls")):
            value = getattr(req, src)
            if value is not None:
                chat_raw[dst] = value
        chat_req = parse_chat_request(chat_raw)
        run = _Run(req)
        ctx = Context()
        streaming = bool(req.stream)
        with self.admission.run(request, ctx, req.model, "responses", streaming,
                                 req.max_output_tokens) as flight:
            # streamed, the SSE writer counts the tokens; folded here, the deltas do
            stream = _deltas(model.chat(chat_req, chat_raw, ctx), run, ctx, None if streaming else flight.metrics)
            if streaming:
                resp, flight.ok = await stream_sse(request, stream, ctx, flight.metrics, run)
            else:
                try:
                    async for delta in stream:
                        run.out.feed(delta)
                finally:
                    await stream.aclose()
                run.out.finish(run.status)
                resp = json_response(run.response(run.status))
                flight.ok = True
        if flight.ok and req.store is not False:
            self.store.put(run.id, Stored(run.response(run.status), conversation + [run.out.assistant_message()],
                                          input_items(req)))
        return resp


async def _deltas(chunks: AsyncIterator[Any], run: _Run, ctx: Context,
                  rm: RequestMetrics | None) -> AsyncGenerator[dict[str, Any], None]:
    """The deltas of a chat chunk stream (content, reasoning_content, tool_calls); finish reason and
    usage are noted on ``run``."""
    try:
        async for chunk in chunks:
            if isinstance(chunk, Annotation) or not isinstance(chunk, dict):
                continue
            if chunk.get("usage"):
                run.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason"):
                    run.finish = choice["finish_reason"]
                delta = choice.get("delta")
                if delta and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                    if rm is not None:
                        rm.tokens(ctx.completion_tokens, ctx.prompt_tokens, ctx.cached_tokens)
                    yield delta
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]

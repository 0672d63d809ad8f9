"""``POST /v1/responses``: the Responses API for text, on top of the chat pipeline.

The request becomes a chat completion (see ``protocols/responses.py``), runs through the model's
``chat`` stream like any other, and the chunks are folded into a ``response`` object, or streamed as the
documented events: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short), each with a ``sequence_number``.

``previous_response_id`` continues a conversation: the stored responses (the conversation up to and
including each answer, without its ``instructions``, as the API defines) live in a bounded in-memory
store, ``DYN_RESPONSES_STORE_SIZE`` entries (default 1000, oldest evicted first); ``store: false`` keeps
a response out of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncGenerator, AsyncIterator

import orjson
from aiohttp import web

from dynamo.errors import EngineError, RequestError
from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context
from dynamo.llm.http.errors import error_body
from dynamo.llm.http.service import _SSE_HEADERS, _json, _read_json
from dynamo.llm.protocols.openai import parse_chat_request
from dynamo.llm.protocols.responses import ResponsesRequest, input_messages, parse_responses_request

log = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1000


class ResponseStore:
    """Conversations by response id, least recently used evicted first."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        conv = self._items.get(response_id)
        if conv is not None:
            self._items.move_to_end(response_id)
        return conv

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = conversation
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def store_size_from_env() -> int:
    raw = os.environ.get("DYN_RESPONSES_STORE_SIZE")
    if raw is None:
        return DEFAULT_STORE_SIZE
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("DYN_RESPONSES_STORE_SIZE=%r is not a whole number; using %d", raw, DEFAULT_STORE_SIZE)
        return DEFAULT_STORE_SIZE


class _Run:
    """One response being produced: ids, the text so far, and the shapes of the response object."""

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.seq = 0

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, status: str, done: bool) -> dict[str, Any]:
        content = [self.part("".join(self.text))] if done else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

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
            "model": req.model, "output": [self.item(status, True)] if done else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "metadata": req.metadata or {}, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice or "auto", "tools": [], "truncation": "disabled",
            "text": {"format": {"type": "text"}}, "reasoning": None, "background": False,
            "usage": usage,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


class ResponsesRoute:
    def __init__(self, service: Any):
        self.service = service
        self.store = ResponseStore(store_size_from_env())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await _read_json(request)
        req = parse_responses_request(raw)
        model = self.service.models.get(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise RequestError(f"Previous response with id '{req.previous_response_id}' not found.",
                                   status=404, param="previous_response_id")
            history = list(prev)
        conversation = history + input_messages(req)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        chat_raw: dict[str, Any] = {"model": req.model, "messages": messages, "stream": True,
                                    "stream_options": {"include_usage": True}}
        for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user")):
            value = getattr(req, src)
            if value is not None:
                chat_raw[dst] = value
        chat_req = parse_chat_request(chat_raw)
        run = _Run(req)
        ctx = Context()
        streaming = bool(req.stream)
        rm = self.service.metrics.request(req.model, "responses", streaming)
        task = asyncio.current_task()
        if task is not None:
            self.service._inflight.add(task)  # graceful shutdown waits for us like for chat requests
        self.service._contexts.add(ctx)
        ok = False
        try:
            stream = _texts(model.chat(chat_req, chat_raw, ctx), run, ctx, rm)
            if streaming:
                resp, ok = await self._stream(request, stream, run, ctx)
            else:
                try:
                    async for _ in stream:
                        pass
                finally:
                    await stream.aclose()
                resp = _json(run.response(run.status))
                ok = True
        except asyncio.CancelledError:
            ctx.kill()
            raise
        finally:
            rm.done(ok)
            self.service._contexts.discard(ctx)
            if task is not None:
                self.service._inflight.discard(task)
        if ok and req.store is not False:
            self.store.put(run.id, conversation + [{"role": "assistant", "content": "".join(run.text)}])
        return resp

    async def _stream(self, request: web.Request, stream: AsyncGenerator[str, None], run: _Run,
                      ctx: Context) -> tuple[web.StreamResponse, bool]:
        try:  # the first text before the 200, so a failure at the start gets its status code
            first: str | None = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        ok = False
        try:
            await resp.prepare(request)
            w = resp.write
            await w(run.event("response.created", response=run.response("in_progress")))
            await w(run.event("response.in_progress", response=run.response("in_progress")))
            await w(run.event("response.output_item.added", output_index=0, item=run.item("in_progress", False)))
            await w(run.event("response.content_part.added", item_id=run.msg_id, output_index=0, content_index=0,
                              part=run.part("")))
            where = {"item_id": run.msg_id, "output_index": 0, "content_index": 0}
            try:
                if first is not None:
                    await w(run.event("response.output_text.delta", delta=first, logprobs=[], **where))
                    async for text in stream:
                        await w(run.event("response.output_text.delta", delta=text, logprobs=[], **where))
            except (EngineError, RequestError) as e:
                log.warning("response %s failed mid-stream: %s", run.id, e)
                code = e.status if isinstance(e, RequestError) else 500
                err = orjson.loads(error_body(str(e), code))["error"]
                await w(run.event("error", code=str(err["code"]), message=err["message"], param=None))
                await resp.write_eof()
                return resp, False
            full = "".join(run.text)
            await w(run.event("response.output_text.done", text=full, logprobs=[], **where))
            await w(run.event("response.content_part.done", part=run.part(full), **where))
            await w(run.event("response.output_item.done", output_index=0, item=run.item("completed", True)))
            status = run.status
            await w(run.event(f"response.{status}", response=run.response(status)))
            await resp.write_eof()
            ok = True
        except (ConnectionResetError, ConnectionError):
            ctx.kill()
            log.debug("response %s: client went away", run.id)
        finally:
            await stream.aclose()
        return resp, ok


async def _texts(chunks: AsyncIterator[Any], run: _Run, ctx: Context, rm: Any) -> AsyncGenerator[str, None]:
    """The text deltas of a chat chunk stream; finish reason and usage are noted on ``run``."""
    try:
        async for chunk in chunks:
            if isinstance(chunk, Annotation) or not isinstance(chunk, dict):
                continue
            if chunk.get("usage"):
                run.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason"):
                    run.finish = choice["finish_reason"]
                text = (choice.get("delta") or {}).get("content")
                if text:
                    run.text.append(text)
                    rm.tokens(ctx.completion_tokens, ctx.prompt_tokens)
                    yield text
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]

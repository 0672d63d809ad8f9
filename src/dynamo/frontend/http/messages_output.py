"""An Anthropic message built from the chat stream, with the stream events that build it.

The chat pipeline's parsers split an answer into ``reasoning_content``, ``content`` and ``tool_calls``
deltas; each run of one kind becomes one content block, in the order the model wrote them: ``thinking``,
``text``, one ``tool_use`` per call (``input`` from the call's JSON arguments).  A block opens with its
first delta and closes when another kind starts or the answer ends, so a stream sends, per block,
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``; around them ``message_start`` and a ``ping`` first, ``message_delta`` (the stop
reason and the usage) and ``message_stop`` last.

The chat finish reason becomes the stop reason: ``length`` -> ``max_tokens``, ``tool_calls`` ->
``tool_use``, ``stop`` -> ``stop_sequence`` when a stop string ended it (the chunk's ``stop_reason``,
which then is ``stop_sequence``) else ``end_turn``.  Usage: ``input_tokens``, ``output_tokens`` and
``cache_read_input_tokens`` (the prompt tokens the engine reused from its prefix cache; null when the
engine does not say).  Thinking blocks carry an empty ``signature``: nothing here signs them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from dynamo.frontend.http.errors import anthropic_error_body
from dynamo.frontend.http.sse import line_safe
from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context

log = logging.getLogger(__name__)

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + line_safe(orjson.dumps(body)) + b"\n\n"


class _Block:
    __slots__ = ("kind", "index", "parts", "id", "name")

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str | None = None):
        self.kind = kind
        self.index = index
        self.parts: list[str] = []
        self.id = call_id
        self.name = name

    def start(self) -> dict[str, Any]:
        """The block as ``content_block_start`` shows it: empty."""
        if self.kind == "text":
            return {"type": "text", "text": ""}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "text":
            return {"type": "text", "text": text}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        try:
            args = orjson.loads(text) if text.strip() else {}
        except orjson.JSONDecodeError:
            log.warning("tool call %s: arguments are not JSON: %r", self.name, text[:200])
            args = {}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": args if isinstance(args, dict) else {}}

    def delta(self, text: str) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text_delta", "text": text}
        if self.kind == "thinking":
            return {"type": "thinking_delta", "thinking": text}
        return {"type": "input_json_delta", "partial_json": text}


class MessageBuilder:
    """One message being produced from chat chunks.  As the stream's SSE format (sse.py's
    ``SseFormat``) it writes Anthropic's events; :meth:`message` is the whole message (unary)."""

    def __init__(self, model: str, ctx: Context, omit_thinking: bool = False):
        self.model = model
        self.omit_thinking = omit_thinking  # ``display: omitted``: thinking blocks without their text
        self.ctx = ctx
        self.id = "msg_" + ctx.id.replace("-", "")
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}  # chat tool-call index -> its block
        self.finish: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] | None = None
        self.created = time.time()

    # -- the chat stream in
    def feed(self, chunk: Any) -> list[bytes]:
        """Take one chat chunk; the events it makes."""
        if isinstance(chunk, Annotation) or not isinstance(chunk, dict):
            return []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content")
            if reasoning:
                self._text("thinking", "" if self.omit_thinking else reasoning, out)
            content = delta.get("content")
            if content:
                self._text("text", content, out)
            for entry in delta.get("tool_calls") or ():
                self._call(entry, out)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                stop = choice.get("stop_reason")
                self.stop_sequence = stop if isinstance(stop, str) else None
        return out

    def _text(self, kind: str, text: str, out: list[bytes]) -> None:
        block = self._open
        if block is None or block.kind != kind:
            block = self._begin(kind, out)
        if not text:  # an omitted thought: its block, without the text
            return
        block.parts.append(text)
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                 "delta": block.delta(text)}))

    def _call(self, entry: dict[str, Any], out: list[bytes]) -> None:
        index = entry.get("index", 0)
        fn = entry.get("function") or {}
        block = self._calls.get(index)
        if block is None:
            block = self._begin("tool_use", out, entry.get("id") or f"toolu_{self.id}_{index}", fn.get("name") or "")
            self._calls[index] = block
        args = fn.get("arguments")
        if args:
            block.parts.append(args)
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                     "delta": block.delta(args)}))

    def _begin(self, kind: str, out: list[bytes], call_id: str | None = None, name: str | None = None) -> _Block:
        self._close(out)
        block = _Block(kind, len(self.blocks), call_id, name)
        self.blocks.append(block)
        self._open = block
        out.append(event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                 "content_block": block.start()}))
        return block

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self._open.index}))
            self._open = None

    # -- what goes out
    @property
    def stop_reason(self) -> str:
        reason = self.finish or "stop"
        if reason == "stop":
            return "stop_sequence" if self.stop_sequence is not None else "end_turn"
        return _STOP_REASONS.get(reason, "end_turn")

    def usage_body(self) -> dict[str, Any]:
        u = self.usage or {}
        ctx = self.ctx
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") if u else ctx.cached_tokens
        return {"input_tokens": int(u.get("prompt_tokens", ctx.prompt_tokens)),
                "output_tokens": int(u.get("completion_tokens", ctx.completion_tokens)),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self) -> dict[str, Any]:
        """The whole message (after the stream ended)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [b.whole() for b in self.blocks], "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence if self.stop_reason == "stop_sequence" else None,
                "usage": self.usage_body()}

    # -- as the stream's SSE format
    def item(self, chunk: Any) -> bytes:
        return b"".join(self.feed(chunk))

    def begin(self) -> list[bytes]:
        ctx = self.ctx
        start: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": 0,
                           "cache_read_input_tokens": ctx.cached_tokens, "cache_creation_input_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": start}),
                event("ping", {"type": "ping"})]

    def end(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        reason = self.stop_reason
        out.append(event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence if reason == "stop_sequence" else None},
            "usage": self.usage_body()}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def failed(self, message: str, status: int) -> bytes:
        return b"event: error\ndata: " + anthropic_error_body(message, status) + b"\n\n"

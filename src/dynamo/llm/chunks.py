"""Building OpenAI stream chunks for one request, shaped as the OpenAI API sends them.

One builder per request holds the fields every chunk repeats, so the per-token cost is one small dict.
The role goes on the first chunk only (the chat route splits it off into a role-only opening chunk:
:func:`split_opening`); usage, when asked for, comes in a final chunk with no choices.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from dynamo.llm.logprobs import CompletionLogprobs, Entry


class Annotation:
    """An in-stream event that is not a chunk (``nvext.annotations``): SSE ``event: name``."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any):
        self.name = name
        self.value = value


class ChatChunks:
    __slots__ = ("id", "created", "model", "_first")

    def __init__(self, model: str, request_id: str | None = None):
        self.id = f"chatcmpl-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._first = True

    def delta(self, text: str | None, finish_reason: str | None = None,
              logprobs: list[Entry] | None = None) -> dict[str, Any]:
        """``logprobs``: the entries of the tokens this text came from (None: not asked for)."""
        if self._first:
            self._first = False
            delta: dict[str, Any] = {"role": "assistant", "content": text if text is not None else ""}
        else:
            delta = {"content": text} if text is not None else {}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason}],
        }

    def text_template(self) -> tuple[bytes, bytes]:
        """The JSON of a later chunk (no role, no logprobs, no finish reason) around its content: a
        stream's chunk is ``prefix + orjson.dumps(text) + suffix``, the same bytes as :meth:`delta`'s
        dict encoded, at a fraction of the cost (one string encoded instead of three dicts built and
        encoded per token)."""
        return _split_at({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}],
        }, b'"content":')

    def parsed(self, delta: dict[str, Any], logprobs: list[Entry] | None = None) -> dict[str, Any]:
        """A chunk for a delta from the response parser (reasoning_content or tool_calls or content)."""
        if self._first:
            self._first = False
            delta = {"role": "assistant", "content": None, **delta}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": None}],
        }

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_dict(prompt_tokens, completion_tokens, cached_tokens),
        }


class CompletionChunks:
    __slots__ = ("id", "created", "model", "_lp")

    def __init__(self, model: str, request_id: str | None = None):
        self.id = f"cmpl-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._lp: CompletionLogprobs | None = None

    def delta(self, text: str | None, finish_reason: str | None = None,
              logprobs: list[Entry] | None = None) -> dict[str, Any]:
        """``logprobs``: the entries of the tokens this text came from (None: not asked for), given in the
        legacy shape with offsets counted over the whole choice."""
        shaped = None
        if logprobs is not None:
            if self._lp is None:
                self._lp = CompletionLogprobs()
            shaped = self._lp.shape(logprobs)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}],
        }

    def text_template(self) -> tuple[bytes, bytes]:
        """As :meth:`ChatChunks.text_template`: a chunk with text only, around its text."""
        return _split_at({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
        }, b'"text":')

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_dict(prompt_tokens, completion_tokens, cached_tokens),
        }


def _split_at(chunk: dict[str, Any], key: bytes) -> tuple[bytes, bytes]:
    """``chunk``'s JSON split around the empty string value of ``key`` (which occurs once: a quote inside
    a JSON string, such as the model name, is escaped)."""
    raw = orjson.dumps(chunk)
    at = raw.index(key + b'""') + len(key)
    return raw[:at], raw[at + 2:]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object.  ``prompt_tokens_details.cached_tokens`` only when the engine reported a
    count: an engine that says nothing about its cache is not claimed to have hit nothing."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chat or completions chunk carries ('' for none)."""
    choices = chunk.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def chunk_finish_reason(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices")
    if not choices:
        return None
    return choices[0].get("finish_reason")


CHAT_CHUNK = "chat.completion.chunk"


def split_opening(item: Any) -> list[Any]:
    """A chat stream's first chunk of a choice as OpenAI and vLLM send it: a role-only chunk
    (``delta: {"role": "assistant", "content": ""}``, ``logprobs`` null) before the first token.

    Why at the edge rather than in :class:`ChatChunks`: several producers build chat chunks (the pipeline,
    the echo and mistral.rs engines, a remote Chat worker of an older build whose chunks arrive as bytes),
    and every one puts the role on its first content chunk; clients that look for the opening chunk (or for
    ``content`` null there) break on that.  Splitting where the route streams covers them all at the cost
    of one look at the first chunk.  Anything that is not a chat chunk with a role and something else in
    its delta comes back unchanged, alone.
    """
    if not isinstance(item, dict) or item.get("object") != CHAT_CHUNK:
        return [item]
    choices = item.get("choices")
    if not choices or len(choices) != 1:
        return [item]
    choice = choices[0]
    delta = choice.get("delta") or {}
    if "role" not in delta:
        return [item]
    rest = {k: v for k, v in delta.items() if k != "role"}
    carries = any(v not in (None, "") for v in rest.values()) or choice.get("logprobs") is not None \
        or choice.get("finish_reason") is not None
    if not carries:
        return [item]
    head = {k: v for k, v in item.items() if k != "choices"}
    opening = {**head, "choices": [{"index": choice.get("index", 0), "delta": {"role": delta["role"], "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    if rest.get("content") == "" and any(k != "content" and v is not None for k, v in rest.items()):
        rest["content"] = None  # a tool call or reasoning chunk: its content stays null, as OpenAI sends it
    elif rest == {"content": ""}:
        rest = {}  # nothing was generated: the finishing chunk's delta is empty, as on any later chunk
    body = {**head, "choices": [{**choice, "delta": rest}]}
    return [opening, body]


async def opening_chunks(stream: Any, choices: int) -> Any:
    """``stream`` with :func:`split_opening` applied to the first chunk of each of its ``choices``: for
    streams whose first item may not be the one to split (``n`` > 1, annotations first)."""
    seen: set[int] = set()
    try:
        async for item in stream:
            if len(seen) < choices and isinstance(item, dict) and item.get("object") == CHAT_CHUNK \
                    and item.get("choices"):
                index = item["choices"][0].get("index", 0)
                if index not in seen:
                    seen.add(index)
                    for part in split_opening(item):
                        yield part
                    continue
            yield item
    finally:
        await stream.aclose()

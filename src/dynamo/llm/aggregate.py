"""Fold a chunk stream into one unary response (spec 4.4, OpenAI shapes)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from dynamo.llm.chunks import Annotation, chunk_text, usage_dict
from dynamo.llm.engine import Context
from dynamo.llm.parsers.fold import ParsedFold


async def _fold(
    stream: AsyncIterator[Any], extra: ParsedFold | None = None
) -> tuple[dict[str, Any], str, str | None, dict[str, Any] | None]:
    """(first chunk, the text, the last finish reason, the usage) of a chat or completions stream;
    ``extra`` collects what a response parser added (reasoning, tool calls)."""
    parts: list[str] = []
    finish: str | None = None
    head: dict[str, Any] = {}
    usage = None
    async for chunk in stream:
        if isinstance(chunk, Annotation):
            continue
        head = head or chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        text = chunk_text(chunk)
        if text:
            parts.append(text)
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
            if extra is not None:
                extra.add(choice.get("delta"))
    return head, "".join(parts), finish, usage


async def fold_chat(stream: AsyncIterator[Any], ctx: Context, model: str) -> dict[str, Any]:
    extra = ParsedFold()
    head, text, finish, usage = await _fold(stream, extra)
    return {
        "id": head.get("id", f"chatcmpl-{ctx.id}"),
        "object": "chat.completion",
        "created": head.get("created", 0),
        "model": head.get("model", model),
        "choices": [
            {
                "index": 0,
                "message": extra.message(text),
                "logprobs": None,
                "finish_reason": finish or "stop",
            }
        ],
        "usage": usage or _usage(ctx),
    }


async def fold_completion(stream: AsyncIterator[Any], ctx: Context, model: str) -> dict[str, Any]:
    head, text, finish, usage = await _fold(stream)
    return {
        "id": head.get("id", f"cmpl-{ctx.id}"),
        "object": "text_completion",
        "created": head.get("created", 0),
        "model": head.get("model", model),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish or "stop"}],
        "usage": usage or _usage(ctx),
    }


def _usage(ctx: Context) -> dict[str, Any]:
    return usage_dict(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)

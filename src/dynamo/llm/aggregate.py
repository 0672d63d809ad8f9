"""Fold a chunk stream into one unary response (OpenAI's unary shapes), a choice per ``index``."""

from __future__ import annotations

from typing import Any, AsyncIterator

from dynamo.llm.chunks import Annotation, usage_dict
from dynamo.llm.engine import Context
from dynamo.llm.parsers.fold import ParsedFold


class _Choice:
    __slots__ = ("parts", "finish", "stop_reason", "parsed", "logprobs")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finish: str | None = None
        self.stop_reason: str | None = None  # vLLM's field: the stop string that ended the answer
        self.parsed = ParsedFold()  # what a response parser added (reasoning, tool calls)
        self.logprobs: dict[str, list[Any]] | None = None  # the chunks' logprobs lists, concatenated

    def add_logprobs(self, lp: dict[str, Any]) -> None:
        """Chat ``{"content": [...]}`` or the completions lists (``tokens``, ``token_logprobs``, ...)."""
        if self.logprobs is None:
            self.logprobs = {k: [] for k in lp}
        for k, v in lp.items():
            self.logprobs.setdefault(k, []).extend(v or ())


async def _fold(stream: AsyncIterator[Any]) -> tuple[dict[str, Any], dict[int, _Choice], dict[str, Any] | None]:
    """(first chunk, the choices by index, the usage) of a chat or completions stream."""
    choices: dict[int, _Choice] = {}
    head: dict[str, Any] = {}
    usage = None
    async for chunk in stream:
        if isinstance(chunk, Annotation):
            continue
        head = head or chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index") or 0
            acc = choices.get(index)
            if acc is None:
                acc = choices[index] = _Choice()
            delta = choice.get("delta")
            text = (delta or {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                acc.parts.append(text)
            if choice.get("finish_reason"):
                acc.finish = choice["finish_reason"]
            if choice.get("stop_reason") is not None:
                acc.stop_reason = choice["stop_reason"]
            if delta:
                acc.parsed.add(delta)
            lp = choice.get("logprobs")
            if lp:
                acc.add_logprobs(lp)
    return head, choices or {0: _Choice()}, usage


async def fold_chat(stream: AsyncIterator[Any], ctx: Context, model: str) -> dict[str, Any]:
    head, choices, usage = await _fold(stream)
    return {
        "id": head.get("id", f"chatcmpl-{ctx.id}"),
        "object": "chat.completion",
        "created": head.get("created", 0),
        "model": head.get("model", model),
        "choices": [
            _with_stop_reason({
                "index": i,
                "message": c.parsed.message("".join(c.parts)),
                "logprobs": c.logprobs,
                "finish_reason": c.finish or "stop",
            }, c)
            for i, c in sorted(choices.items())
        ],
        "usage": usage or _usage(ctx),
    }


async def fold_completion(stream: AsyncIterator[Any], ctx: Context, model: str) -> dict[str, Any]:
    head, choices, usage = await _fold(stream)
    return {
        "id": head.get("id", f"cmpl-{ctx.id}"),
        "object": "text_completion",
        "created": head.get("created", 0),
        "model": head.get("model", model),
        "choices": [_with_stop_reason({"index": i, "text": "".join(c.parts), "logprobs": c.logprobs,
                                       "finish_reason": c.finish or "stop"}, c)
                    for i, c in sorted(choices.items())],
        "usage": usage or _usage(ctx),
    }


def _with_stop_reason(choice: dict[str, Any], acc: _Choice) -> dict[str, Any]:
    """The unary choice carries the matched stop string as its streamed last chunk does."""
    if acc.stop_reason is not None:
        choice["stop_reason"] = acc.stop_reason
    return choice


def _usage(ctx: Context) -> dict[str, Any]:
    return usage_dict(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)

"""The Responses API request (``POST /v1/responses``), text only, mapped onto a chat request.

What we can honour becomes a chat completion request (``input`` string or message items,
``instructions`` as a system message, ``max_output_tokens``, ``temperature``, ``top_p``); what we cannot
(tools, images and files, background runs, structured output formats, reasoning options) is a 400 that
names the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.errors import RequestError
from dynamo.llm.protocols.openai import _convert


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


_TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses_request(raw: Any) -> ResponsesRequest:
    req: ResponsesRequest = _convert(raw, ResponsesRequest)
    if req.tools:
        raise RequestError("'tools' are not supported on /v1/responses yet; use /v1/chat/completions",
                           param="tools")
    if req.tool_choice not in (None, "auto", "none"):
        raise RequestError("'tool_choice' is not supported without tools", param="tool_choice")
    if req.background:
        raise RequestError("Background responses are not supported", param="background")
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("Only the 'text' output format is supported", param="text.format")
    if req.reasoning:
        raise RequestError("'reasoning' options are not supported", param="reasoning")
    if req.truncation not in (None, "disabled"):
        raise RequestError("Only truncation 'disabled' is supported", param="truncation")
    if req.include:
        raise RequestError("'include' is not supported", param="include")
    if req.prompt is not None:
        raise RequestError("Prompt templates ('prompt') are not supported", param="prompt")
    if req.top_logprobs:
        raise RequestError("'top_logprobs' is not supported on /v1/responses", param="top_logprobs")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError("max_output_tokens must be at least 1", param="max_output_tokens")
    return req


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (``developer`` becomes ``system``, as most chat templates know it)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("'input' cannot be empty", param="input")
    out = []
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be a message object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind != "message":
            raise RequestError(f"input items of type '{kind}' are not supported (text messages only)",
                               param=f"input[{i}].type")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestError(f"input[{i}].role must be user, assistant, system or developer",
                               param=f"input[{i}].role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(item.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"input[{i}].content must be a string or a list of parts", param=f"input[{i}].content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"content parts of type '{kind}' are not supported (text only)",
                               param=f"input[{i}].content")
        texts.append(part["text"])
    return "\n".join(texts)

"""The Responses API request (``POST /v1/responses``) mapped onto a chat completion request.

What we can honour becomes a chat completion request: ``input`` (a string, or items: messages,
``function_call`` and ``function_call_output`` from an agent loop, ``reasoning``), ``instructions`` as
a system message, function ``tools`` and ``tool_choice`` as chat tools, ``max_output_tokens``,
``temperature``, ``top_p``; a user message's ``input_image`` parts become the chat ``image_url`` parts
(llm/media loads them).  What we cannot (built-in tools, files and image file ids, background runs,
structured output formats, reasoning options) is a 400 that names the field, never silently dropped.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from dynamo.errors import RequestError
from dynamo.llm.protocols.openai import convert_request


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
    max_tool_calls: int | None = None  # a bound on built-in tool calls, of which we run none


_TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses_request(raw: Any) -> ResponsesRequest:
    req: ResponsesRequest = convert_request(raw, ResponsesRequest)
    chat_tools(req)  # a built-in tool or a malformed one is a 400 before anything runs
    chat_tool_choice(req)
    if req.background:
        raise RequestError("Background responses are not supported", param="background")
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("Only the 'text' output format is supported", param="text.format")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise RequestError("'reasoning' options are not supported (the model's reasoning, if it writes any, "
                           "comes back as a 'reasoning' output item)", param="reasoning")
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


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as chat
    tools; a built-in tool (web_search, file_search, ...) is a 400 naming it: we have none to run."""
    if not req.tools:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(f"Built-in tool '{kind}' is not supported (tools[{i}]); only function tools are",
                               param=f"tools[{i}].type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].name must be a non-empty string", param=f"tools[{i}].name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        fn = {"name": name, **{k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(req: ResponsesRequest) -> Any:
    """``tool_choice`` in the chat shape: ``none``/``auto``/``required`` as they are, a function
    ``{"type": "function", "name"}`` as ``{"type": "function", "function": {"name"}}``."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        if choice == "required" and not req.tools:
            raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            names = {t.get("name") for t in req.tools or () if isinstance(t, dict)}
            if choice["name"] not in names:
                raise RequestError(f"tool_choice names function {choice['name']!r}, which is not in tools",
                                   param="tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        if isinstance(kind, str) and kind != "function":
            raise RequestError(f"tool_choice of type '{kind}' is not supported (function tools only)",
                               param="tool_choice")
    raise RequestError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                       param="tool_choice")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages.  ``developer`` becomes ``system``, as most chat templates know it;
    ``function_call`` items become the ``tool_calls`` of an assistant message (joined to the assistant
    text just before them, as the model wrote both in one turn), ``function_call_output`` items become
    ``tool`` messages, and a ``reasoning`` item's text the ``reasoning_content`` of the assistant turn
    after it (templates that show earlier thinking, such as Qwen3's in a tool loop, render it)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("'input' cannot be empty", param="input")
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"input[{i}].role must be user, assistant, system or developer",
                                   param=f"input[{i}].role")
            content = (_user_content(item.get("content"), f"input[{i}].content") if role == "user"
                       else _content_text(item.get("content"), f"input[{i}].content"))
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", i), "type": "function",
                    "function": {"name": _str_field(item, "name", i), "arguments": _str_field(item, "arguments", i)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise RequestError(f"input items of type '{kind}' are not supported (messages, function_call, "
                               "function_call_output and reasoning are)", param=f"input[{i}].type")
    return out


_ITEM_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as the API lists it back (``GET /v1/responses/{id}/input_items``): items with ids, a
    string as a user message, string contents as text parts.  Call after :func:`input_messages`, which
    validates the items."""
    if isinstance(req.input, str):
        return [_listed_message({"role": "user", "content": req.input})]
    out = []
    for item in req.input:
        kind = item.get("type", "message")
        listed = _listed_message(item) if kind == "message" else dict(item)
        listed.setdefault("id", _ITEM_ID_PREFIX.get(kind, "item_") + uuid.uuid4().hex)
        if kind != "reasoning":
            listed.setdefault("status", "completed")
        out.append(listed)
    return out


def _listed_message(item: dict[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if isinstance(content, str):
        part = "output_text" if role == "assistant" else "input_text"
        content = [{"type": part, "text": content, **({"annotations": []} if role == "assistant" else {})}]
    return {**item, "type": "message", "id": item.get("id") or "msg_" + uuid.uuid4().hex, "role": role,
            "content": content, "status": item.get("status") or "completed"}


def _str_field(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"input[{i}].{key} must be a string", param=f"input[{i}].{key}")
    return value


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """The reasoning item's text (its ``content``, else its ``summary``); None when it has none (an
    encrypted one from another service: nothing we can read)."""
    for key in ("content", "summary"):
        parts = item.get(key) or ()
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "".join(texts)
    return None


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: its text, or, when it holds ``input_image`` parts, OpenAI chat parts
    (text and ``image_url``) in order, for the pre-processor to read as any chat request's images."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _content_text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(_image_part(part, f"{where}[{j}]"))
        else:
            parts.append({"type": "text", "text": _content_text([part], where)})
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise RequestError("input_image.file_id is not supported (there is no Files API here); send image_url, a "
                           "data: or https:// URL", param=f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise RequestError("input_image needs image_url: a data: or https:// URL", param=f"{where}.image_url")
    detail = part.get("detail")
    if detail not in (None, "auto", "low", "high"):
        raise RequestError("input_image.detail must be 'auto', 'low' or 'high'", param=f"{where}.detail")
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of parts", param=where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"content parts of type '{kind}' are not supported (text only)", param=where)
        texts.append(part["text"])
    return "\n".join(texts)

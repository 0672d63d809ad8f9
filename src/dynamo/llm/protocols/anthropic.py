"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a chat request.

A Messages request becomes the same chat completion request the OpenAI chat route runs, so the chat
template, the tool-call parsers and the reasoning parsers treat both alike:

* ``system`` (a string or text blocks) -> a system message; ``messages`` with content blocks -> chat
  messages: ``text`` blocks -> content, an assistant's ``tool_use`` blocks -> its ``tool_calls`` (``input``
  as a JSON string spaced as models write it and OpenAI clients send it), a user's ``tool_result`` blocks -> ``tool`` messages
  (before the user's text of the same turn, which came after the results), ``thinking`` -> the assistant
  turn's ``reasoning_content`` (templates that show earlier thinking render it).
* ``tools`` (``input_schema``) -> function tools; ``tool_choice`` ``auto``/``any``/``tool``/``none`` ->
  ``auto``/``required``/a named function/``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls``.
* ``thinking`` -> ``chat_template_kwargs.enable_thinking``: on for ``enabled`` and ``adaptive`` (the model
  decides), off for ``disabled`` or no ``thinking`` (the API thinks only when asked); ``budget_tokens`` is
  checked as the API does (at least 1024, below ``max_tokens``) but the model's thinking is bounded by
  ``max_tokens`` alone: nothing can end a thought early and still let the model answer.  ``display:
  omitted`` returns thinking blocks without their text, as the API does.
* ``output_config.format`` (a JSON schema) -> ``response_format``: guided decoding, where the engine can.
* ``stop_sequences``, ``temperature`` (0 to 1), ``top_p``, ``top_k``, ``max_tokens`` (required),
  ``metadata.user_id`` -> ``user``.

* ``image`` blocks in a user turn (base64 and url sources) -> ``image_url`` parts, a base64 source as a
  ``data:`` URL, so the pre-processor reads every API's images alike (llm/media).

What cannot be honoured is a 400 naming the field: documents, images outside a user turn's content,
server tools, ``output_config.effort``, unknown fields.  ``cache_control`` marks (on blocks, or the
request's own) are accepted and need nothing: the engines reuse cached prefixes by themselves, and
``usage.cache_read_input_tokens`` reports what they reused.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from dynamo.errors import RequestError
from dynamo.llm.protocols.openai import MAX_STOP_SEQUENCES, check_ranges, convert_request

MIN_THINKING_BUDGET = 1024  # the API's own lower bound on thinking.budget_tokens


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``/v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # the prefix cache is automatic: nothing to do


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either is served as asked


_RANGES: dict[str, tuple[float, float]] = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0)}  # Anthropic's


def parse_messages_request(raw: Any) -> MessagesRequest:
    req: MessagesRequest = convert_request(raw, MessagesRequest)
    if req.max_tokens < 1:
        raise RequestError("max_tokens: must be at least 1", param="max_tokens")
    check_ranges(req, _RANGES)
    if req.top_k is not None and req.top_k < 1:
        raise RequestError("top_k: must be at least 1", param="top_k")
    if req.stop_sequences is not None:
        if len(req.stop_sequences) > MAX_STOP_SEQUENCES:
            raise RequestError(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported",
                               param="stop_sequences")
        if any(not s for s in req.stop_sequences):
            raise RequestError("stop_sequences: each must be a non-empty string", param="stop_sequences")
    _thinking(req, req.max_tokens)
    return req


def parse_count_tokens_request(raw: Any) -> CountTokensRequest:
    if isinstance(raw, dict) and "max_tokens" in raw:  # the SDK's count_tokens does not send it; some clients do
        raw = {k: v for k, v in raw.items() if k != "max_tokens"}
    req: CountTokensRequest = convert_request(raw, CountTokensRequest)
    _thinking(req, None)
    return req


def _thinking(req: CountTokensRequest, max_tokens: int | None) -> bool:
    """Whether thinking is on; a malformed ``thinking`` is a 400."""
    cfg = req.thinking
    if cfg is None:
        return False
    kind = cfg.get("type")
    if kind == "disabled" and set(cfg) == {"type"}:
        return False
    allowed = {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set())
    if kind not in ("enabled", "adaptive") or set(cfg) - allowed:
        raise RequestError("thinking: expected {\"type\": \"enabled\", \"budget_tokens\": N}, "
                           "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}", param="thinking")
    if cfg.get("display") not in (None, "summarized", "omitted"):
        raise RequestError("thinking.display: must be 'summarized' or 'omitted'", param="thinking.display")
    if kind == "adaptive":
        return True
    budget = cfg.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise RequestError(f"thinking.budget_tokens: must be an integer of at least {MIN_THINKING_BUDGET}",
                           param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise RequestError("thinking.budget_tokens: must be less than max_tokens", param="thinking.budget_tokens")
    return True


def thinking_omitted(req: CountTokensRequest) -> bool:
    """``thinking.display: omitted``: thinking blocks come back without their text."""
    return bool(req.thinking) and req.thinking.get("display") == "omitted"  # type: ignore[union-attr]


def _response_format(cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config`` as the chat ``response_format``; ``effort`` is a 400 (no model here has the knob)."""
    if not cfg:
        return None
    extra = set(cfg) - {"format", "effort"}
    if extra:
        raise RequestError(f"output_config.{sorted(extra)[0]}: not supported", param=f"output_config.{sorted(extra)[0]}")
    if cfg.get("effort") is not None:
        raise RequestError("output_config.effort: the models served here have no effort setting",
                           param="output_config.effort")
    fmt = cfg.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(req: CountTokensRequest) -> dict[str, Any]:
    """The chat completion request (as its JSON body) that serves ``req``; streamed, with usage."""
    messages = _system(req.system) + _messages(req.messages)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True},
                            "chat_template_kwargs": {"enable_thinking": _thinking(req, None)}}
    tools = _tools(req.tools)
    if tools:
        chat["tools"] = tools
    fmt = _response_format(req.output_config)
    if fmt is not None:
        chat["response_format"] = fmt
    if req.tool_choice is not None:
        choice, parallel = _tool_choice(req.tool_choice, tools)
        chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    if isinstance(req, MessagesRequest):
        chat["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(req, name)
            if value is not None:
                chat[name] = value
        if req.stop_sequences:
            chat["stop"] = list(req.stop_sequences)
        if req.metadata is not None and req.metadata.user_id is not None:
            chat["user"] = req.metadata.user_id
    return chat


# -- content blocks ---------------------------------------------------------------------------------

_HARMLESS_KEYS = frozenset({"cache_control"})  # prompt-caching hints: our engines cache prefixes anyway
_UNSUPPORTED_MEDIA = ("document", "search_result")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # the API's four


def _block_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = set(block) - allowed - _HARMLESS_KEYS - {"type"}
    if extra:
        name = sorted(extra)[0]
        raise RequestError(f"{where}.{name}: not supported in a '{block.get('type')}' block",
                           param=f"{where}.{name}")


def _text(block: dict[str, Any], where: str) -> str:
    _block_keys(block, {"text", "citations"}, where)
    if block.get("citations"):
        raise RequestError(f"{where}.citations: citations are not supported", param=f"{where}.citations")
    text = block.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text: must be a string", param=f"{where}.text")
    return text


def _blocks(content: Any, where: str, images: bool = False) -> list[dict[str, Any]]:
    """``content`` as a list of blocks (a string is one text block); each checked to be an object with a
    type; ``image`` blocks only where ``images`` (a user turn's own content)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content blocks", param=where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}.{i}: must be a content block with a 'type'", param=f"{where}.{i}")
        if block["type"] in _UNSUPPORTED_MEDIA:
            raise RequestError(f"{where}.{i}: '{block['type']}' input is not supported here (text and images are)",
                               param=f"{where}.{i}.type")
        if block["type"] == "image" and not images:
            raise RequestError(f"{where}.{i}: image blocks are taken in a user turn's content only (not in a "
                               "system prompt or a tool result)", param=f"{where}.{i}.type")
    return content


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An ``image`` block as the OpenAI part the pre-processor reads: a base64 source as a ``data:`` URL, a
    url source as its URL (fetched under the server's media policy)."""
    _block_keys(block, {"source"}, at)
    source: Any = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        _block_keys(source, {"media_type", "data"}, f"{at}.source")
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise RequestError(f"{at}.source.media_type: must be one of {', '.join(IMAGE_MEDIA_TYPES)}",
                               param=f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise RequestError(f"{at}.source.data: must be the image as a base64 string", param=f"{at}.source.data")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        _block_keys(source, {"url"}, f"{at}.source")
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise RequestError(f"{at}.source.url: must be a URL string", param=f"{at}.source.url")
    elif kind == "file":
        raise RequestError(f"{at}.source: file sources (the Files API) are not supported here; send the image "
                           "as base64 or url", param=f"{at}.source.type")
    else:
        raise RequestError(f"{at}.source: expected {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                           "{\"type\": \"url\", \"url\"}", param=f"{at}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _system(system: str | list[Any] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    blocks = _blocks(system, "system")
    texts = []
    for i, block in enumerate(blocks):
        if block["type"] != "text":
            raise RequestError(f"system.{i}: only text blocks can make the system prompt", param=f"system.{i}.type")
        texts.append(_text(block, f"system.{i}"))
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    if not messages:
        raise RequestError("messages: at least one message is required", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise RequestError(f"{where}: must be an object with 'role' and 'content'", param=where)
        extra = set(msg) - {"role", "content"}
        if extra:
            raise RequestError(f"{where}.{sorted(extra)[0]}: unknown field", param=f"{where}.{sorted(extra)[0]}")
        role = msg.get("role")
        if role == "user":
            out += _user_turn(_blocks(msg.get("content"), f"{where}.content", images=True), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_turn(_blocks(msg.get("content"), f"{where}.content"), f"{where}.content"))
        else:
            raise RequestError(f"{where}.role: must be 'user' or 'assistant'", param=f"{where}.role")
    return out


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Tool results first (they answer the assistant turn before), then the user's text, and images
    where they stood among it (the content becomes OpenAI parts then)."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and image parts in order, when there is an image
    for i, block in enumerate(blocks):
        kind, at = block["type"], f"{where}.{i}"
        if kind == "text":
            texts.append(_text(block, at))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            _block_keys(block, {"tool_use_id", "content", "is_error"}, at)
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{at}.tool_use_id: must be a non-empty string", param=f"{at}.tool_use_id")
            content = block.get("content", "")
            text = "\n".join(_text(b, f"{at}.content.{j}") if b["type"] == "text" else _not_in_result(b, at)
                             for j, b in enumerate(_blocks(content, f"{at}.content")))
            if block.get("is_error"):
                text = "Error: " + text  # the template has no error flag: the model reads it in the result
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise RequestError(f"{at}.type: '{kind}' blocks are not supported in a user turn (text, image and "
                               "tool_result are)", param=f"{at}.type")
    if len(parts) > len(texts):
        results.append({"role": "user", "content": parts})
    elif texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _not_in_result(block: dict[str, Any], at: str) -> str:
    raise RequestError(f"{at}.content: a tool result may hold text only (got '{block['type']}')",
                       param=f"{at}.content")


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for i, block in enumerate(blocks):
        kind, at = block["type"], f"{where}.{i}"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            _block_keys(block, {"id", "name", "input"}, at)
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise RequestError(f"{at}: a tool_use block needs 'id', 'name' and an object 'input'", param=at)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking":
            _block_keys(block, {"thinking", "signature"}, at)
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{at}.thinking: must be a string", param=f"{at}.thinking")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another service: nothing a model here can read
        else:
            raise RequestError(f"{at}.type: '{kind}' blocks are not supported in an assistant turn (text, "
                               "tool_use and thinking are)", param=f"{at}.type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


# -- tools ------------------------------------------------------------------------------------------


def _tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise RequestError(f"{at}: must be an object", param=at)
        kind = tool.get("type", "custom")
        if kind != "custom":  # server tools (web_search_..., bash_..., text_editor_...) run on Anthropic's side
            raise RequestError(f"{at}.type: server tool '{kind}' is not available here; only client tools "
                               "(name, description, input_schema) are", param=f"{at}.type")
        extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if extra:
            raise RequestError(f"{at}.{sorted(extra)[0]}: not supported", param=f"{at}.{sorted(extra)[0]}")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{at}.name: must be a non-empty string", param=f"{at}.name")
        if not isinstance(schema, dict):
            raise RequestError(f"{at}.input_schema: must be a JSON schema object", param=f"{at}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, bool | None]:
    """The chat ``tool_choice`` and ``parallel_tool_calls`` (None: not said)."""
    kind = choice.get("type")
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if extra or (kind != "tool" and "name" in choice):
        raise RequestError("tool_choice: unexpected field", param="tool_choice")
    no_parallel = choice.get("disable_parallel_tool_use")
    parallel = None if no_parallel is None else not no_parallel
    if kind == "none":
        return "none", parallel
    if not tools:
        raise RequestError(f"tool_choice: '{kind}' needs tools", param="tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise RequestError("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")

"""Tool calls for a model whose chat template shows no tool-call format: a generic JSON format, prompt and parser.

Why: Anthropic clients (Claude Code among them) send ``tools`` with every request, and OpenAI agent loops
do too; a model whose template renders no tools would otherwise refuse every such request, and so could not
be used from those clients at all.  llama-server answers the same situation with a generic JSON format; so
do we, with our own wording:

* **prompt**: a system message (put before the conversation's own system text, in the same message, so a
  template that allows one system message still renders) lists the tools as JSON (name, description, the
  JSON Schema of the parameters) and asks for a call as nothing but ``{"name": ..., "arguments": {...}}``,
  one object per line for several.  The conversation's earlier calls are written the same way in their
  assistant turns, and the tools' results become user turns (``Result of tool NAME: ...``), since a
  template that knows no tools knows no ``tool`` role either.
* **parser**: an answer that opens with ``{`` and holds such objects is the call(s) (the Llama 3 JSON
  machinery of :mod:`.json_calls`, which streams the arguments as they come); anything else is content,
  and a JSON object without a ``name`` is content too.

Without guided decoding nothing forces a small model to follow the format; a model that answers in prose
simply answers (content), which is what a client without tools would have seen.
"""

from __future__ import annotations

import json
from typing import Any

from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser

GENERIC = "generic"

INSTRUCTIONS = (
    "You can call the tools listed below. To call one, reply with nothing but a JSON object of the form "
    '{"name": "<tool name>", "arguments": {<arguments matching its parameters>}}; to call several, write one '
    "such object per line. After a call, the tool's result comes back in the next message. When no tool is "
    "needed, reply to the user in plain text.\nTools:\n"
)


class GenericJsonParser(JsonCallsParser):
    """The answer *is* the call(s): JSON objects opening the output, one per line (or ``;``-separated)."""

    bare_start = "{"
    skip = (";",)


def tool_list(tools: list[Any]) -> str:
    """The tools as the prompt lists them: one JSON object per tool, a line each."""
    lines = []
    for tool in tools:
        fn = (tool.get("function") if isinstance(tool, dict) else None) or {}
        entry = {"name": fn.get("name"), "description": fn.get("description") or "",
                 "parameters": fn.get("parameters") or {"type": "object", "properties": {}}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


def call_lines(calls: list[Any]) -> str:
    """An assistant turn's earlier calls in the format the model is asked to write."""
    lines = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: shown as the string it is
        lines.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
    return "\n".join(lines)


def generic_tool_messages(messages: list[dict[str, Any]], tools: list[Any]) -> list[dict[str, Any]]:
    """The conversation as a template without tool support can render it, told about ``tools``."""
    names: dict[str, str] = {}  # call id -> function name, so a result can say whose it is
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                if call.get("id"):
                    names[call["id"]] = (call.get("function") or {}).get("name", "")
            text = m.get("content") or ""
            lines = call_lines(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}\n{lines}" if text else lines})
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "", "") or m.get("name") or "a tool"
            out.append({"role": "user", "content": f"Result of tool {name}: {m.get('content') or ''}"})
        else:
            out.append(m)
    system = INSTRUCTIONS + tool_list(tools)
    if out and out[0].get("role") == "system":
        first = out[0]
        out[0] = {**first, "content": f"{system}\n\n{first.get('content') or ''}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out

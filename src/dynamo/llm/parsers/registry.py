"""Parsers by name (the names vLLM and Dynamo use), and ``auto``: the choice a chat template implies.

A model card records the resolved names (``tool_call_parser``, ``reasoning_parser``: a name or None), so
a frontend parses a remote worker's output the way the worker was started to.
"""

from __future__ import annotations

from typing import Any, Callable

from dynamo.errors import UserError
from dynamo.llm.parsers.base import ToolCallParser
from dynamo.llm.parsers.harmony import HarmonyParser
from dynamo.llm.parsers.reasoning import ThinkParser, deepseek_r1, qwen3
from dynamo.llm.parsers.tool_calls.deepseek_v3 import CALLS_BEGIN, DeepSeekV3Parser
from dynamo.llm.parsers.tool_calls.generic import GENERIC, GenericJsonParser
from dynamo.llm.parsers.tool_calls.hermes import HermesParser
from dynamo.llm.parsers.tool_calls.llama3_json import Llama3JsonParser
from dynamo.llm.parsers.tool_calls.mistral import MistralParser
from dynamo.llm.parsers.tool_calls.pythonic import PythonicParser

TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
    "harmony": HarmonyParser,
    GENERIC: GenericJsonParser,  # ours: the fallback for templates that show no format (tool_calls/generic.py)
}
REASONING_PARSERS: dict[str, Callable[..., ThinkParser | HarmonyParser]] = {
    "deepseek_r1": deepseek_r1,
    "qwen3": qwen3,
    "gpt_oss": lambda reasoning_first=False: HarmonyParser(tools=False),
}
AUTO, NONE = "auto", "none"


def tool_call_parser_names() -> list[str]:
    return [AUTO, NONE, *TOOL_CALL_PARSERS]


def reasoning_parser_names() -> list[str]:
    return [AUTO, NONE, *REASONING_PARSERS]


def template_text(template: Any) -> str:
    """All of a card's chat template text (a string, or named templates)."""
    if template is None:
        return ""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))


def detect_tool_call_parser(template: Any) -> str | None:
    """The tool-call format a chat template teaches the model, or None if it renders no tools."""
    text = template_text(template)
    if "tools" not in text and "tool_calls" not in text:
        return None
    if "<|channel|>" in text:
        return "harmony"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if CALLS_BEGIN in text or "tool▁calls▁begin" in text:
        return "deepseek_v3"
    if "[func_name1(" in text or "<|python_start|>" in text:
        return "pythonic"
    if "<|python_tag|>" in text or ('"parameters"' in text and "ipython" in text):
        return "llama3_json"
    return None


def detect_reasoning_parser(template: Any) -> str | None:
    text = template_text(template)
    if "<|channel|>" in text:
        return "gpt_oss"
    if "<think>" not in text:
        return None
    return "qwen3" if "enable_thinking" in text else "deepseek_r1"


def resolve(kind: str, name: str | None, template: Any) -> str | None:
    """A flag's value as a card records it: a parser name, or None for no parsing."""
    names = TOOL_CALL_PARSERS if kind == "tool" else REASONING_PARSERS
    if name is None or name == AUTO:
        return detect_tool_call_parser(template) if kind == "tool" else detect_reasoning_parser(template)
    if name == NONE:
        return None
    if name not in names:
        flag = "--tool-call-parser" if kind == "tool" else "--reasoning-parser"
        valid = ", ".join([AUTO, NONE, *names])
        raise UserError(f"{flag} {name!r} is not a known parser. Valid: {valid}")
    return name

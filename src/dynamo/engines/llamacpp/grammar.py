"""Guided decoding for ``out=llamacpp``: our ``guided_decoding`` dict as a llama.cpp GBNF grammar.

JSON schemas (``guided_json``, ``response_format``, forced tool calls) go through llama-cpp-python's
``json_schema_to_gbnf``; ``guided_choice`` becomes an alternation of literal strings; ``guided_grammar`` is
taken as GBNF.  Regular expressions have no converter, so the engine does not declare ``regex`` and the
pre-processor refuses them with a 400.
"""

from __future__ import annotations

import json
from typing import Any

from dynamo.errors import RequestError

KINDS = ("json", "choice", "grammar")


def gbnf_for(guided: dict[str, Any] | None) -> str | None:
    """The grammar for a request (None when it has no constraint); a schema we cannot convert is a 400."""
    if not guided:
        return None
    if guided.get("json") is not None:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        schema = guided["json"]
        try:
            return json_schema_to_gbnf(schema if isinstance(schema, str) else json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for what it lacks
            raise RequestError(f"the JSON schema cannot be turned into a llama.cpp grammar: {e}",
                               param="response_format") from None
    if guided.get("choice"):
        return "root ::= " + " | ".join(_literal(str(c)) for c in guided["choice"])
    if guided.get("grammar") is not None:
        return str(guided["grammar"])
    if guided.get("regex") is not None:
        raise RequestError("out=llamacpp cannot constrain output with a regular expression", param="guided_regex")
    return None


def _literal(text: str) -> str:
    """A GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'

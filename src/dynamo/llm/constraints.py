"""Output constraints a request asks for, and whether the engine can honour them.

``response_format`` (``json_object``, ``json_schema``) becomes our ``guided_decoding`` dict like the
``guided_*`` fields; an engine that cannot constrain output that way makes the request a 400 naming the
field, never a 200 with unconstrained text.  Known fields no token engine honours yet (
``best_of`` > 1, ``suffix``) are 400s too, and so is ``logit_bias`` on an engine that does not apply it.  A model card lists the kinds its engine does
(``guided_decoding``: json, regex, grammar, choice).
"""

from __future__ import annotations

from typing import Any

from dynamo.errors import RequestError

GUIDED_KINDS = ("json", "regex", "grammar", "choice")
_FIELD = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar", "choice": "guided_choice"}


def engine_guided_kinds(declared: Any) -> list[str]:
    """An engine's ``guided_decoding`` attribute as a list of kinds: True for all, a list for those."""
    if declared is True:
        return list(GUIDED_KINDS)
    if isinstance(declared, (list, tuple, set, frozenset)):
        return [k for k in GUIDED_KINDS if k in declared]
    return []


def response_format_guided(value: Any) -> dict[str, Any] | None:
    """``response_format`` as a guided-decoding dict (None for text / absent); malformed: a 400."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json": {"type": "object"}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs json_schema.schema (an object)",
                               param="response_format")
        return {"json": schema}
    raise RequestError("response_format type must be 'text', 'json_object' or 'json_schema'", param="response_format")


def check_guided(guided: dict[str, Any] | None, source: str | None, supported: list[str], model: str) -> None:
    """A 400 naming the field if the engine cannot apply this constraint."""
    if not guided:
        return
    for kind in GUIDED_KINDS:
        if guided.get(kind) is not None and kind not in supported:
            field = source or _FIELD[kind]
            does = f"it does {', '.join(supported)} only" if supported else "it does no guided decoding"
            raise RequestError(f"{field}: the engine serving {model!r} cannot constrain its output this way "
                               f"({does}), so it cannot honour this request", param=field)


def logit_bias_of(raw: dict[str, Any], supported: bool, vocab_size: int) -> dict[str, float] | None:
    """``logit_bias`` checked as OpenAI does (token ids in the vocabulary, biases in [-100, 100]); a 400 if
    the engine cannot apply it."""
    bias = raw.get("logit_bias")
    if not bias:
        return None
    if not supported:
        raise RequestError("logit_bias is not supported by this model's engine", param="logit_bias")
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must map token ids to biases", param="logit_bias")
    out: dict[str, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: token id {token} is out of vocabulary (size {vocab_size})",
                               param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias: the bias of token {token} must be a number in [-100, 100]",
                               param="logit_bias")
        out[str(token)] = float(value)
    return out


def check_unhonoured(raw: dict[str, Any]) -> None:
    """Known OpenAI fields our token engines do not honour yet: a 400 rather than silence."""
    best_of = raw.get("best_of")
    if isinstance(best_of, int) and best_of > 1:
        raise RequestError("best_of > 1 is not supported (one sequence per request)", param="best_of")
    if raw.get("suffix"):
        raise RequestError("suffix is not supported by this model's engine", param="suffix")

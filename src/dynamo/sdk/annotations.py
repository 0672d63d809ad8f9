"""Reading a method's request annotation, the one rule endpoints and ``@api`` routes share.

A pydantic model (anything with ``model_validate``, so pydantic is not imported, nor required, by the SDK)
is built from what arrives: JSON text or a mapping.  Any other annotation is left alone: the value is
passed as it came off the wire.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable


def is_model(ann: Any) -> bool:
    return isinstance(ann, type) and callable(getattr(ann, "model_validate", None))


def request_annotation(fn: Callable[..., Any]) -> Any:
    """The annotation of the first parameter after ``self`` (None when there is none)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    if not params:
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: use what is written
        hints = {}
    ann = hints.get(params[0].name, params[0].annotation)
    return None if ann is inspect.Parameter.empty else ann


def convert(ann: Any, value: Any) -> Any:
    if ann is None or not is_model(ann):
        return value
    if isinstance(value, (str, bytes)):
        return ann.model_validate_json(value)
    return ann.model_validate(value)

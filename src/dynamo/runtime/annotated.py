"""``Annotated``: the envelope of every stream item, as the original sends it: ``{"data"?, "id"?, "event"?, "comment"?}``.

Handlers yield plain dicts (wrapped as ``{"data": item}``) or Annotated objects when they need events or
comments (e.g. LLM in-stream annotations). An item whose event is ``"error"`` is an error; its comments
hold the message.  An item whose event is ``"drained"`` (our addition) ends a stream that a draining worker
stopped before it was done: everything before it was delivered, the rest must come from another worker
(a frontend without this addition ignores the data-less annotation and sees an incomplete stream).
"""

from __future__ import annotations

from typing import Any

import orjson

ERROR_EVENT = "error"
DRAINED_EVENT = "drained"


class Annotated:
    __slots__ = ("_data", "_id", "_event", "_comment")

    def __init__(self, data: Any = None, id: str | None = None, event: str | None = None,
                 comment: list[str] | None = None) -> None:
        self._data = data
        self._id = id
        self._event = event
        self._comment = comment

    @classmethod
    def from_error(cls, message: str) -> "Annotated":
        return cls(event=ERROR_EVENT, comment=[message])

    @classmethod
    def from_dict(cls, obj: dict) -> "Annotated":
        return cls(obj.get("data"), obj.get("id"), obj.get("event"), obj.get("comment"))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self._data is not None:
            out["data"] = self._data
        if self._id is not None:
            out["id"] = self._id
        if self._event is not None:
            out["event"] = self._event
        if self._comment is not None:
            out["comment"] = self._comment
        return out

    # accessor methods mirror the original Python binding (.data(), .event(), ...)
    def data(self) -> Any:
        return self._data

    def id(self) -> str | None:
        return self._id

    def event(self) -> str | None:
        return self._event

    def comments(self) -> list[str] | None:
        return self._comment

    def is_error(self) -> bool:
        return self._event == ERROR_EVENT

    def error_message(self) -> str:
        return "; ".join(self._comment or []) or "unknown error"

    def __repr__(self) -> str:
        return f"Annotated({orjson.dumps(self.to_dict()).decode()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Annotated) and self.to_dict() == other.to_dict()


class BareItem(Annotated):
    """A stream item that Dynamo 1.x peers read without the Annotated layer: ``{"data": <item>}`` on their
    wire rather than ``{"data": {"data": <item>}}``.  1.x wraps the items of its LLM endpoints in Annotated
    but not those of its control endpoints (the KV recovery query, whose answer it reads as an enum:
    ``{"TreeDump": ...}``).  Our own wire carries it as any Annotated item with this data."""

    __slots__ = ()

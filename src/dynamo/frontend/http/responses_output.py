"""A response's output items, built from the chat stream's deltas, with the stream events that build them.

The chat pipeline's parsers split an answer into ``reasoning_content``, ``content`` and ``tool_calls``
deltas; each run of one kind becomes one output item, in the order the model wrote them: a ``reasoning``
item (its text as one ``reasoning_text`` part), a ``message`` (one ``output_text`` part), one
``function_call`` item per call (``call_id`` is the chat call's id, ``arguments`` a JSON string).
Items open when their first delta arrives and close when another kind starts or the answer ends, so a
stream sends, per item: ``response.output_item.added``, (for text) ``response.content_part.added``, the
deltas, the ``.done`` events, ``response.output_item.done``.  An answer with no output at all still
gets an empty message, so clients always find one item.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = tuple[str, dict[str, Any]]

_TEXT_KINDS = {  # item type -> (part type, delta event, done event)
    "message": ("output_text", "response.output_text.delta", "response.output_text.done"),
    "reasoning": ("reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done"),
}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


class _Item:
    __slots__ = ("kind", "id", "index", "texts", "call_id", "name", "status")

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str | None = None):
        prefix = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[kind]
        self.kind = kind
        self.id = prefix + uuid.uuid4().hex
        self.index = index
        self.texts: list[str] = []
        self.call_id = call_id
        self.name = name
        self.status = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def shape(self) -> dict[str, Any]:
        """The item as the API shows it: empty while in progress (stream ``added`` events), whole after."""
        done = self.status != "in_progress"
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                    "arguments": self.text if done else "", "status": self.status}
        content = [_part(self.kind, self.text)] if done else []
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": self.status, "role": "assistant", "content": content}
        return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": self.status}


class OutputItems:
    """The output of one response.  ``feed`` takes a chat delta and returns the stream events it makes."""

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # chat tool-call index -> its item

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            self._text("reasoning", reasoning, events)
        content = delta.get("content")
        if content:
            self._text("message", content, events)
        for entry in delta.get("tool_calls") or ():
            self._call(entry, events)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the last item with ``status`` (``completed``, or ``incomplete`` when the token limit cut
        it); an empty answer gets its empty message here."""
        events: list[Event] = []
        if not self.items:
            self._start("message", events)
        self._close(events, status)
        return events

    def output(self) -> list[dict[str, Any]]:
        return [item.shape() for item in self.items]

    @property
    def text(self) -> str:
        """All ``output_text`` (what the SDK's ``response.output_text`` shows)."""
        return "".join(item.text for item in self.items if item.kind == "message")

    def assistant_message(self) -> dict[str, Any]:
        """The answer as a chat assistant message, for the conversation a later ``previous_response_id``
        continues: its text, its calls, and its reasoning."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items if i.kind == "function_call"]
        if calls:
            msg["content"] = msg["content"] or None
            msg["tool_calls"] = calls
        reasoning = "".join(i.text for i in self.items if i.kind == "reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        return msg

    # -- items opening and closing ----------------------------------------------------------------

    def _text(self, kind: str, text: str, events: list[Event]) -> None:
        item = self._open
        if item is None or item.kind != kind:
            item = self._start(kind, events)
        item.texts.append(text)
        events.append((_TEXT_KINDS[kind][1], {"item_id": item.id, "output_index": item.index, "content_index": 0,
                                              "delta": text, **({"logprobs": []} if kind == "message" else {})}))

    def _call(self, entry: dict[str, Any], events: list[Event]) -> None:
        fn = entry.get("function") or {}
        item = self._calls.get(entry.get("index", 0))
        if item is None or entry.get("id"):
            call_id = entry.get("id") or "call_" + uuid.uuid4().hex
            item = self._start("function_call", events, call_id=call_id, name=fn.get("name") or "")
            self._calls[entry.get("index", 0)] = item
        arguments = fn.get("arguments")
        if arguments:
            item.texts.append(arguments)
            if item is self._open:
                events.append(("response.function_call_arguments.delta",
                               {"item_id": item.id, "output_index": item.index, "delta": arguments}))

    def _start(self, kind: str, events: list[Event], **call: Any) -> _Item:
        self._close(events, "completed")
        item = _Item(kind, len(self.items), **call)
        self.items.append(item)
        self._open = item
        events.append(("response.output_item.added", {"output_index": item.index, "item": item.shape()}))
        if kind in _TEXT_KINDS:
            events.append(("response.content_part.added", {"item_id": item.id, "output_index": item.index,
                                                           "content_index": 0, "part": _part(kind, "")}))
        return item

    def _close(self, events: list[Event], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind in _TEXT_KINDS:
            text = item.text
            events.append((_TEXT_KINDS[item.kind][2], {**where, "content_index": 0, "text": text,
                                                       **({"logprobs": []} if item.kind == "message" else {})}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": _part(item.kind, text)}))
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item.name,
                                                                     "arguments": item.text}))
        events.append(("response.output_item.done", {"output_index": item.index, "item": item.shape()}))

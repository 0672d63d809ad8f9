"""The responses ``/v1/responses`` keeps: bounded, in memory, least recently used evicted first.

``DYN_RESPONSES_STORE_SIZE`` entries (default 1000; 0 keeps none), per server process.  Each holds what
``GET /v1/responses/{id}`` returns, the conversation ``previous_response_id`` continues, and the
request's input items for ``GET /v1/responses/{id}/input_items``.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1000


@dataclass
class Stored:
    """A stored response: the object ``GET /v1/responses/{id}`` returns, and the conversation up to and
    including its answer (chat messages, without its ``instructions``) that ``previous_response_id``
    continues."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as listed back


class ResponseStore:
    """Stored responses by id, least recently used evicted first."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def store_size_from_env() -> int:
    raw = os.environ.get("DYN_RESPONSES_STORE_SIZE")
    if raw is None:
        return DEFAULT_STORE_SIZE
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("DYN_RESPONSES_STORE_SIZE=%r is not a whole number; using %d", raw, DEFAULT_STORE_SIZE)
        return DEFAULT_STORE_SIZE

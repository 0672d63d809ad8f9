"""The responses ``/v1/responses`` keeps: bounded, in memory, least recently used evicted first.

``DYN_RESPONSES_STORE_SIZE`` entries (default 1000; 0 keeps none), per server process, and at most
``DYN_RESPONSES_STORE_MB`` (default 32) of their JSON.  Each holds what ``GET /v1/responses/{id}``
returns, the conversation ``previous_response_id`` continues, and the request's input items for
``GET /v1/responses/{id}/input_items``.

Why a byte bound too: an entry holds its whole conversation, so a count alone bounds nothing when prompts
are long (1000 entries of 100k-character conversations: 100s of MB).  Each entry's size is the length
of its JSON (one orjson encode when it is stored: 1.1 us for a 2 KB entry, timeit), which understates
what the Python objects hold: 1.6x for an entry of a 600-character prompt (5.4 KB held against 3.3 KB
of JSON, tracemalloc), more for many short strings.  With the soak's mix (benchmarks/soak.py) the 1000
entries were 2 MB of JSON and the count is what binds; 32 MB of JSON is ~50 MB of objects.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from dynamo.bounds import track

log = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_MB = 32.0


@dataclass
class Stored:
    """A stored response: the object ``GET /v1/responses/{id}`` returns, and the conversation up to and
    including its answer (chat messages, without its ``instructions``) that ``previous_response_id``
    continues."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as listed back
    nbytes: int = 0  # its JSON's length, set when stored


class ResponseStore:
    """Stored responses by id, least recently used evicted first, at most ``size`` of them and
    ``max_bytes`` of their JSON."""

    def __init__(self, size: int, max_bytes: int | None = None):
        self.size = size
        self.max_bytes = int(DEFAULT_STORE_MB * 2**20) if max_bytes is None else max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        track("responses_store_entries", self, len)
        track("responses_store_bytes", self, lambda s: s.bytes)

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.size <= 0:
            return
        stored.nbytes = len(orjson.dumps([stored.response, stored.conversation, stored.input_items],
                                         default=str))
        if stored.nbytes > self.max_bytes:
            log.info("response %s not stored: %d bytes of JSON, more than DYN_RESPONSES_STORE_MB", response_id,
                     stored.nbytes)
            return
        self.delete(response_id)
        self._items[response_id] = stored
        self.bytes += stored.nbytes
        while len(self._items) > self.size or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is None:
            return False
        self.bytes -= old.nbytes
        return True

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


def store_mb_from_env() -> int:
    raw = os.environ.get("DYN_RESPONSES_STORE_MB")
    try:
        return int((DEFAULT_STORE_MB if raw is None else float(raw)) * 2**20)
    except ValueError:
        log.warning("DYN_RESPONSES_STORE_MB=%r is not a number; using %g", raw, DEFAULT_STORE_MB)
        return int(DEFAULT_STORE_MB * 2**20)

"""The worker side of KV events: number and publish them, and remember what they add up to.

An engine describes its cache changes as event *data* (``stored`` / ``removed`` / ``cleared``,
protocols.py); :class:`WorkerKvState` wraps each one with the worker id and an increasing ``event_id``,
hands it to the publisher, and keeps the blocks the events describe.  That record is what a router that
has just started (or lost its NATS connection) asks for with the ``kv_state`` query, instead of staying
blind until new events happen to cover the cache (:meth:`dump`, applied by ``KvRouter.apply_dump``).

Call it from one thread (the worker's event loop): the dump is consistent with the events published so
far because both happen there, and ``last_event_id`` says which events it already includes.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from dynamo.llm.kv_router.hashing import MASK64
from dynamo.llm.kv_router.protocols import kv_event
from dynamo.llm.kv_router.publisher import Publisher, emit


class WorkerKvState:
    def __init__(self, worker_id: int = 0, publish: Publisher | None = None, *, first_event_id: int | None = None):
        self.worker_id = worker_id
        self.publish = publish
        start = random.getrandbits(32) if first_event_id is None else first_event_id
        self._ids = itertools.count(start)
        self.last_event_id: int | None = None
        # block_hash -> (tokens_hash, parent block_hash or None), in the order the blocks were stored
        self.blocks: dict[int, tuple[int, int | None]] = {}

    def send(self, data: Any) -> dict[str, Any]:
        """Record one event's data and publish it, wrapped; returns the wrapped event."""
        event_id = next(self._ids) & MASK64
        self.last_event_id = event_id
        if data == "cleared":
            self.blocks.clear()
        elif "stored" in data:
            body = data["stored"]
            parent = body.get("parent_hash")
            for b in body["blocks"]:
                self.blocks[b["block_hash"]] = (b["tokens_hash"], parent)
                parent = b["block_hash"]
        elif "removed" in data:
            for h in data["removed"]["block_hashes"]:
                self.blocks.pop(h, None)
        event = kv_event(self.worker_id, event_id, data)
        emit(self.publish, event, "KV event")
        return event

    def dump(self) -> dict[str, Any]:
        """Every block this worker holds, parents before children:
        ``{"worker_id", "last_event_id", "blocks": [[block_hash, tokens_hash, parent_hash | None], ...]}``.

        A block whose parent is no longer held is left out: no prefix can reach it, and a router would
        reject it (unknown parent) anyway.
        """
        children: dict[int | None, list[int]] = {}
        for h, (_, parent) in self.blocks.items():
            children.setdefault(parent, []).append(h)
        out: list[list[int | None]] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            h = stack.pop()
            tokens_hash, parent = self.blocks[h]
            out.append([h, tokens_hash, parent])
            stack.extend(reversed(children.get(h, [])))
        return {"worker_id": self.worker_id, "last_event_id": self.last_event_id, "blocks": out}

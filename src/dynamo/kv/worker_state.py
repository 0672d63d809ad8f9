"""The worker side of KV events: number and publish them, and remember what they add up to.

An engine describes its cache changes as event *data* (``stored`` / ``removed`` / ``cleared``,
protocols.py); :class:`WorkerKvState` wraps each one with the worker id and an increasing ``event_id``,
hands it to the publisher, and keeps the blocks the events describe.  That record is what a router that
has just started (or lost its NATS connection) asks for with the recovery query, instead of staying
blind until new events happen to cover the cache (:meth:`dump`, applied by ``KvRouter.apply_dump``).

Blocks offloaded to a lower tier (host memory, disk: ``tier``) are numbered in the same sequence and kept
apart per tier; the dump carries them under ``tiers``.

Call it from one thread (the worker's event loop): the dump is consistent with the events published so
far because both happen there, and ``last_event_id`` says which events it already includes.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from dynamo.kv.events import DEVICE, kv_event
from dynamo.kv.hashing import MASK64
from dynamo.kv.publisher import Publisher, emit


class WorkerKvState:
    def __init__(self, worker_id: int = 0, publish: Publisher | None = None, *, first_event_id: int | None = None):
        self.worker_id = worker_id
        self.publish = publish
        start = random.getrandbits(32) if first_event_id is None else first_event_id
        self._ids = itertools.count(start)
        self.last_event_id: int | None = None
        # block_hash -> (tokens_hash, parent block_hash or None), in the order the blocks were stored
        self.blocks: dict[int, tuple[int, int | None]] = {}
        self.lower: dict[str, dict[int, tuple[int, int | None]]] = {}  # tier -> its blocks, as ``blocks``

    def send(self, data: Any, tier: str = DEVICE) -> dict[str, Any]:
        """Record one event's data (of ``tier``) and publish it, wrapped; returns the wrapped event."""
        event_id = next(self._ids) & MASK64
        self.last_event_id = event_id
        blocks = self.blocks if tier == DEVICE else self.lower.setdefault(tier, {})
        if data == "cleared":
            blocks.clear()
            if tier == DEVICE:  # a cleared device is a restarted cache: every tier goes
                self.lower.clear()
        elif "stored" in data:
            body = data["stored"]
            parent = body.get("parent_hash")
            for b in body["blocks"]:
                blocks[b["block_hash"]] = (b["tokens_hash"], parent)
                parent = b["block_hash"]
        elif "removed" in data:
            for h in data["removed"]["block_hashes"]:
                blocks.pop(h, None)
        # a device ``cleared`` goes out without a tier: every tier of this worker is void
        event = kv_event(self.worker_id, event_id, data, tier)
        emit(self.publish, event, "KV event")
        return event

    def dump(self) -> dict[str, Any]:
        """Every block this worker holds, parents before children:
        ``{"worker_id", "last_event_id", "blocks": [[block_hash, tokens_hash, parent_hash | None], ...],
        "tiers": {tier: [...same shape...]}}`` (``tiers`` only when a lower tier holds blocks).

        A block whose parent is no longer held is left out: no prefix can reach it, and a router would
        reject it (unknown parent) anyway.
        """
        out: dict[str, Any] = {"worker_id": self.worker_id, "last_event_id": self.last_event_id,
                               "blocks": _chains(self.blocks)}
        tiers = {t: _chains(b) for t, b in self.lower.items() if b}
        if tiers:
            out["tiers"] = tiers
        return out


def _chains(blocks: dict[int, tuple[int, int | None]]) -> list[list[int | None]]:
    children: dict[int | None, list[int]] = {}
    for h, (_, parent) in blocks.items():
        children.setdefault(parent, []).append(h)
    out: list[list[int | None]] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        h = stack.pop()
        tokens_hash, parent = blocks[h]
        out.append([h, tokens_hash, parent])
        stack.extend(reversed(children.get(h, [])))
    return out

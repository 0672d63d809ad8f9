"""The shapes of the events between workers and routers, as our code keeps them (on the event plane they
travel in Dynamo 1.x's form, MessagePack in its envelope: :mod:`dynamo.kv.v1_events`).

KV event (what an engine hands its worker; topic ``kv-events`` of its endpoint as a 1.x RouterEvent)::

    {"worker_id": <i64>, "event": {"event_id": <u64>, "data": <data>}, "storage_tier": <tier>}

``storage_tier`` (Dynamo's RouterEvent field) says where the blocks are: ``"device"`` (absent: the
engine's own KV cache, the only tier before offloading), ``"host_pinned"`` (host memory) or ``"disk"``.
Blocks in a lower tier are *restorable*, not resident: the router credits them less (docs/routing.md).
vLLM's ``medium`` spellings (``GPU``, ``CPU``, ``CPU_PINNED``, ``CPU_TIER2``, ``DISK``...) are accepted
for the same field; an unknown tier makes the event invalid (never silently counted as resident).
``"cleared"`` without a tier clears every tier of that worker (it restarted); with one, that tier only.

    data = {"stored": {"parent_hash": <u64|null>, "blocks": [{"block_hash": <u64>, "tokens_hash": <u64>}, ...]}}
         | {"removed": {"block_hashes": [<u64>, ...]}}
         | "cleared"

``block_hash`` is the engine's name for the block (the mocker uses the sequence hash); ``tokens_hash`` is
the local hash of the block's tokens (hashing.py), from which the router computes the
sequence hash its index is keyed by.

Hit-rate event (published by a KV router as topic ``kv-hit-rate`` of its workers' endpoint after each decision)::

    {"worker_id": <i64>, "isl_blocks": <int>, "overlap_blocks": <int>}

Active-sequence events (router replica sync, topic ``active_sequences_events`` of the workers' endpoint)
are Dynamo 1.6.1's ActiveSequenceEventBatch, with our heartbeat beside it: :mod:`dynamo.kv.replica_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, NamedTuple

import orjson

from dynamo.kv.hashing import MASK64

# -- building (worker side) --------------------------------------------------------------------------

def stored_data(parent_hash: int | None, blocks: Iterable[tuple[int, int]]) -> dict[str, Any]:
    """``blocks``: (block_hash, tokens_hash) pairs, in prefix order, the first one a child of parent."""
    return {"stored": {"parent_hash": parent_hash,
                       "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in blocks]}}


def removed_data(block_hashes: Iterable[int]) -> dict[str, Any]:
    return {"removed": {"block_hashes": list(block_hashes)}}


CLEARED_DATA = "cleared"

DEVICE = "device"
HOST = "host_pinned"
DISK = "disk"
# the tiers below the device, nearest first (the order restorable prefixes are extended in)
LOWER_TIERS = (HOST, DISK)
_TIER_NAMES = {
    "device": DEVICE, "gpu": DEVICE, "xpu": DEVICE,
    "host_pinned": HOST, "cpu": HOST, "cpu_pinned": HOST, "cpu_tier1": HOST, "host": HOST,
    "disk": DISK, "cpu_tier2": DISK, "nvme": DISK, "storage": DISK,
}


def parse_tier(value: Any) -> str:
    """A tier name (``storage_tier`` or vLLM's ``medium``) to one of DEVICE, HOST, DISK; None is DEVICE."""
    if value is None:
        return DEVICE
    tier = _TIER_NAMES.get(value.lower()) if isinstance(value, str) else None
    if tier is None:
        raise EventError(f"unknown storage tier {value!r}; known: device, host_pinned, disk")
    return tier


def kv_event(worker_id: int, event_id: int, data: Any, tier: str = DEVICE) -> dict[str, Any]:
    event: dict[str, Any] = {"worker_id": worker_id, "event": {"event_id": event_id, "data": data}}
    if tier != DEVICE:  # absent means device: what every consumer before tiers expects
        event["storage_tier"] = tier
    return event


# -- parsing (router side) ---------------------------------------------------------------------------
class EventError(ValueError):
    """A KV event that does not have the expected shape."""


class StoredBlock(NamedTuple):
    block_hash: int
    tokens_hash: int


@dataclass(frozen=True, slots=True)
class KvEvent:
    worker_id: int
    event_id: int
    kind: Literal["stored", "removed", "cleared"]
    parent_hash: int | None = None
    blocks: tuple[StoredBlock, ...] = ()
    block_hashes: tuple[int, ...] = ()
    tier: str | None = None  # DEVICE, HOST or DISK; None only for a ``cleared`` of every tier


def _u64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventError(f"{what} must be an integer, got {value!r}")
    # some producers send hashes as signed i64; the bits are what matter
    return value & MASK64


def parse_kv_event(raw: bytes | str | dict[str, Any]) -> KvEvent:
    """Decode one wrapped KV event; raises :class:`EventError` if it is malformed."""
    if isinstance(raw, (bytes, bytearray, memoryview, str)):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise EventError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise EventError("a KV event must be a JSON object")
    worker_id = raw.get("worker_id")
    if isinstance(worker_id, bool) or not isinstance(worker_id, int):
        raise EventError(f"worker_id must be an integer, got {worker_id!r}")
    event = raw.get("event")
    if not isinstance(event, dict):
        raise EventError("missing 'event' object")
    event_id = event.get("event_id", 0)
    event_id = _u64(event_id, "event_id")
    raw_tier = raw.get("storage_tier", event.get("medium"))
    tier = parse_tier(raw_tier)
    data = event.get("data")
    if data == "cleared" or (isinstance(data, dict) and "cleared" in data):
        return KvEvent(worker_id, event_id, "cleared", tier=None if raw_tier is None else tier)
    return _parse_data(worker_id, event_id, data, tier)


def parse_cache_event(worker_id: int, raw: bytes | str) -> tuple[KvEvent, int]:
    """Decode one *bare* KV cache event, as Dynamo's Python ``RadixTree.apply_event`` takes it: the
    ``event`` part of a KV event (no worker id, no tier), with Dynamo's optional ``dp_rank``.

    ``{"event_id": <u64>, "data": <data>, "dp_rank": <u32, default 0>}``; ``event_id`` is required, as
    in Dynamo.  Returns (the event, its dp_rank); the blocks are always device blocks.  Raises
    :class:`EventError` if it is malformed."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise EventError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise EventError("a KV cache event must be a JSON object")
    if "event_id" not in obj:
        raise EventError("missing field 'event_id'")
    event_id = obj["event_id"]
    if isinstance(event_id, bool) or not isinstance(event_id, int) or not 0 <= event_id <= MASK64:
        raise EventError(f"event_id must be an unsigned 64-bit integer, got {event_id!r}")
    dp_rank = obj.get("dp_rank", 0)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < 1 << 32:
        raise EventError(f"dp_rank must be an unsigned 32-bit integer, got {dp_rank!r}")
    data = obj.get("data")
    if data == "cleared":
        return KvEvent(worker_id, event_id, "cleared", tier=DEVICE), dp_rank
    return _parse_data(worker_id, event_id, data, DEVICE), dp_rank


def _parse_data(worker_id: int, event_id: int, data: Any, tier: str) -> KvEvent:
    """The ``stored`` or ``removed`` body of an event."""
    if not isinstance(data, dict) or len(data) != 1:
        raise EventError(f"event data must be {{'stored': ...}}, {{'removed': ...}} or 'cleared', got {data!r}")
    (kind, body), = data.items()
    if not isinstance(body, dict):
        raise EventError(f"'{kind}' must be an object")
    if kind == "stored":
        parent = body.get("parent_hash")
        parent = None if parent is None else _u64(parent, "parent_hash")
        blocks_raw = body.get("blocks")
        if not isinstance(blocks_raw, list):
            raise EventError("stored.blocks must be a list")
        blocks = []
        for b in blocks_raw:
            try:
                bh, th = b["block_hash"], b["tokens_hash"]
            except (TypeError, KeyError):
                raise EventError("each stored block must be an object with block_hash and tokens_hash") from None
            if type(bh) is not int or type(th) is not int or bh < 0 or th < 0 or bh > MASK64 or th > MASK64:
                bh, th = _u64(bh, "block_hash"), _u64(th, "tokens_hash")
            blocks.append(StoredBlock(bh, th))
        return KvEvent(worker_id, event_id, "stored", parent_hash=parent, blocks=tuple(blocks), tier=tier)
    if kind == "removed":
        hashes = body.get("block_hashes")
        if not isinstance(hashes, list):
            raise EventError("removed.block_hashes must be a list")
        return KvEvent(worker_id, event_id, "removed", block_hashes=tuple(_u64(h, "block_hash") for h in hashes), tier=tier)
    raise EventError(f"unknown event kind {kind!r}")

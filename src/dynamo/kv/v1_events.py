"""KV events and load in Dynamo 1.x's shapes: the only shapes they travel in, so our routers follow our
workers and 1.x's alike, and 1.x routers follow ours.

What travels (MessagePack, inside the event plane's envelope, :mod:`dynamo.runtime.v1_event_wire`;
observed from Dynamo 1.6.1's mocker and frontend):

* topic ``kv-events``: an array of **RouterEvent**
  ``{"worker_id", "storage_tier": "device"|"host_pinned"|"disk", "residency_domain": "worker",
  "event": {"event_id", "data": {"stored": {"parent_hash", "start_position", "blocks": [{"block_hash",
  "tokens_hash", "mm_extra_info"}]}} | {"removed": {"block_hashes"}} | "cleared", "dp_rank"}}``.
  The hashes are ours (:mod:`dynamo.kv.hashing`): ``block_hash`` the sequence hash, ``tokens_hash`` the
  block's own, so the same prompt names the same blocks on both sides.
* topic ``kv_metrics``: **ActiveLoad** ``{"worker_id", "dp_rank", "active_decode_blocks",
  "active_prefill_tokens", "kv_used_blocks"}``; ours add ``forward_pass_metrics`` (the whole report:
  total blocks, usage, queue, slots), which 1.6.1 ignores (tested with its router and frontend).
* The **recovery query** a 1.x router sends a worker's ``worker_kv_query_source_<publisher id hex>``
  endpoint when it starts following it: ``{"worker_id", "dp_rank", "start_event_id", "end_event_id",
  "supports_tree_dump_failed", "kind": "recovery"}``, answered by one item
  ``{"TreeDump": {"events": [RouterEvent...], "last_event_id", "reset_scope": "all"}}``.  A 1.6.1 router
  applies no event of a worker before that answer (tested: with the endpoint unreachable, a repeated
  prompt scores no overlap), nor of a publisher without its ``EventSource`` record
  (:func:`source_metadata`).

Event ids: a 1.x router checks them for gaps from its recovery's ``last_event_id``, so the stream is
numbered by itself, from 1 and without holes (:class:`V1KvNumbering`), whatever the engine's events
carry; our routers read the same numbers.  Nothing of ours is missing from 1.x's shapes: tiers are its
``storage_tier`` (host_pinned, disk), a LoRA adapter is already in the block hashes, and a worker that
lends prefixes says so in its model entry, not in its events.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

from dynamo.kv.events import DEVICE, LOWER_TIERS, EventError, parse_tier
from dynamo.kv.hashing import MASK64

TOPIC_KV_EVENTS = "kv-events"
TOPIC_KV_METRICS = "kv_metrics"
# ours, which 1.x has no reader for: in 1.x's envelope, under the name it had (kv/events.py has the shape)
TOPIC_HIT_RATE = "kv-hit-rate"
# routers' bookings (replica sync), in 1.6.1's shape: ours and 1.6.1's read each other's (replica_sync.py)
TOPIC_ACTIVE_SEQUENCES = "active_sequences_events"
QUERY_SOURCE_PREFIX = "worker_kv_query_source_"
FORWARD_PASS_METRICS = "forward_pass_metrics"  # our whole load report, inside an ActiveLoad (1.6.1 ignores it)

_encoder = msgspec.msgpack.Encoder()


def query_source_endpoint(publisher_id: int) -> str:
    """The name of the recovery endpoint that goes with a ``kv-events`` publisher (1.6.1's naming)."""
    return f"{QUERY_SOURCE_PREFIX}{publisher_id:x}"


def encode_payload(event: dict[str, Any]) -> bytes:
    """One event of our own topics (a map), MessagePack as 1.x's payloads are."""
    return _encoder.encode(event)


def decode_payload(payload: bytes | memoryview) -> dict[str, Any]:
    """The map of one event of our own topics; raises :class:`EventError` when it is not one."""
    try:
        event = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventError(f"not MessagePack: {e}") from None
    if not isinstance(event, dict):
        raise EventError(f"an event is a map, not {type(event).__name__}")
    return event


# -- KV events --------------------------------------------------------------------------------------------

def _v1_data(data: Any) -> Any:
    """Our event data (:mod:`dynamo.kv.events`) with 1.x's optional fields present, as it sends them."""
    if data == "cleared":
        return "cleared"
    if "stored" in data:
        body = data["stored"]
        return {"stored": {"parent_hash": body.get("parent_hash"), "start_position": None,
                           "blocks": [{"block_hash": b["block_hash"], "tokens_hash": b["tokens_hash"],
                                       "mm_extra_info": None} for b in body["blocks"]]}}
    if "removed" in data:
        return {"removed": {"block_hashes": list(data["removed"]["block_hashes"])}}
    raise EventError(f"no 1.x form for event data {data!r}")


def router_event(worker_id: int, event_id: int, data: Any, tier: str = DEVICE, dp_rank: int = 0) -> dict[str, Any]:
    """One 1.x RouterEvent (ids are unsigned on 1.x's wire: one above i64's maximum, negative where we keep
    it, goes as its unsigned self)."""
    return {"worker_id": worker_id & MASK64, "storage_tier": tier, "residency_domain": "worker",
            "event": {"event_id": event_id, "data": _v1_data(data), "dp_rank": dp_rank}}


def encode_router_events(events: Iterable[dict[str, Any]]) -> bytes:
    """The ``kv-events`` payload: a MessagePack array of RouterEvents."""
    return _encoder.encode(list(events))


def decode_router_events(payload: bytes | memoryview) -> list[dict[str, Any]]:
    """A ``kv-events`` payload as RouterEvent dicts, which :func:`dynamo.kv.events.parse_kv_event` reads
    (it ignores the fields it has no use for: ``residency_domain``, ``start_position``, ``mm_extra_info``,
    ``dp_rank``).  Raises :class:`EventError` when it is not an array of maps."""
    try:
        events = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventError(f"not MessagePack: {e}") from None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise EventError("a 1.x kv-events payload is an array of RouterEvent maps")
    return events


class V1KvNumbering:
    """Our KV events of one worker renumbered for 1.x routers: 1, 2, 3... in publishing order, so that the
    router's gap check holds and its recovery (:meth:`tree_dump`) says where the stream stands.

    Call from the thread that publishes (the worker's event loop), as :class:`~dynamo.kv.worker_state.
    WorkerKvState` is: a dump and the numbering then agree on which events it includes."""

    def __init__(self, worker_id: int, dp_rank: int = 0) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.last_event_id = 0

    def translate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Our wrapped KV event (``{"worker_id", "event": {"event_id", "data"}, "storage_tier"?}``) as the
        next 1.x RouterEvents: one, except a ``cleared`` of every tier (no ``storage_tier``: the worker's
        caches restarted), which 1.x has no single event for: a ``cleared`` of each tier, device first."""
        tier = event.get("storage_tier")
        data = event["event"]["data"]
        tiers = [DEVICE, *LOWER_TIERS] if data == "cleared" and tier is None else [parse_tier(tier)]
        out = []
        for t in tiers:
            self.last_event_id += 1
            out.append(router_event(self.worker_id, self.last_event_id, data, t, self.dp_rank))
        return out

    def tree_dump(self, dump: dict[str, Any]) -> dict[str, Any]:
        """The answer to a recovery query: every block of ``dump`` (``WorkerKvState.dump()``) as stored
        events, one per chain, and the id of the last event it includes.

        The dump's events are numbered 1..n; should there be more chains than events published so far, the
        numbering jumps past them, so a live event is never taken for one the dump covered."""
        events: list[dict[str, Any]] = []
        for tier, chains in [(DEVICE, dump.get("blocks") or ()), *sorted((dump.get("tiers") or {}).items())]:
            for parent, blocks in _runs(chains):
                data = {"stored": {"parent_hash": parent, "blocks": [{"block_hash": b, "tokens_hash": t}
                                                                     for b, t in blocks]}}
                events.append(router_event(self.worker_id, len(events) + 1, data, tier, self.dp_rank))
        self.last_event_id = max(self.last_event_id, len(events))
        return {"TreeDump": {"events": events, "last_event_id": self.last_event_id, "reset_scope": "all"}}


def _runs(chains: Iterable[Any]) -> list[tuple[int | None, list[tuple[int, int]]]]:
    """``[[block_hash, tokens_hash, parent], ...]`` (parents first) cut into runs where each block's
    parent is the one before it."""
    runs: list[tuple[int | None, list[tuple[int, int]]]] = []
    last: int | None = None
    for block_hash, tokens_hash, parent in chains:
        if runs and parent is not None and parent == last:
            runs[-1][1].append((block_hash, tokens_hash))
        else:
            runs.append((parent, [(block_hash, tokens_hash)]))
        last = block_hash
    return runs


def dump_from_tree(worker_id: int, answer: Any) -> dict[str, Any]:
    """A 1.x worker's recovery answer as our dump (:meth:`~dynamo.kv.worker_state.WorkerKvState.dump`'s shape) (what ``KvRouter.apply_dump`` takes).
    Raises :class:`EventError` when it is not a ``TreeDump``."""
    body = answer.get("TreeDump") if isinstance(answer, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("events"), list):
        raise EventError(f"not a 1.x TreeDump: {str(answer)[:200]}")
    tiers: dict[str, list[list[int | None]]] = {}
    for ev in body["events"]:
        event = ev.get("event") if isinstance(ev, dict) else None
        data = event.get("data") if isinstance(event, dict) else None
        if not isinstance(data, dict) or "stored" not in data:
            continue  # a tree dump is blocks stored; anything else has nothing to add
        tier = parse_tier(ev.get("storage_tier"))
        chain = tiers.setdefault(tier, [])
        parent = data["stored"].get("parent_hash")
        for b in data["stored"].get("blocks") or ():
            chain.append([b["block_hash"], b["tokens_hash"], parent])
            parent = b["block_hash"]
    out: dict[str, Any] = {"worker_id": worker_id, "last_event_id": body.get("last_event_id"),
                           "blocks": tiers.pop(DEVICE, [])}
    lower = {t: b for t, b in tiers.items() if t in LOWER_TIERS}
    if lower:
        out["tiers"] = lower
    return out


def recovery_query(worker_id: int, dp_rank: int = 0) -> dict[str, Any]:
    """The query a router sends to a worker's recovery endpoint for everything it holds."""
    return {"worker_id": worker_id, "dp_rank": dp_rank, "start_event_id": None, "end_event_id": None,
            "supports_tree_dump_failed": True, "kind": "recovery"}


def source_metadata(namespace: str, component: str, endpoint: str, worker_id: int, publisher_id: int,
                    recovery_target: dict[str, Any], dp_rank: int = 0) -> dict[str, Any]:
    """The ``metadata`` of a ``kv-events`` publisher's ``EventSource`` record: whose cache it describes and
    where a router recovers it (``recovery_target``: the discovery record of the recovery endpoint)."""
    return {"kv_state_endpoint": {"namespace": namespace, "component": component, "name": endpoint},
            "worker": {"worker_id": worker_id & MASK64, "dp_rank": dp_rank}, "publisher_id": publisher_id,
            "recovery_target": recovery_target}


# -- load ---------------------------------------------------------------------------------------------------

def active_load(metrics: dict[str, Any]) -> bytes | None:
    """Our load report (``{"worker_id", "data": ForwardPassMetrics}``) as a ``kv_metrics`` payload: 1.x's
    ActiveLoad, whose ``kv_used_blocks`` is our ``kv_active_blocks`` (the active decode blocks and prefill
    tokens are what a 1.x router counts itself: 1.6.1 sends nil), and the whole report under
    ``forward_pass_metrics``, a field 1.6.1 ignores, which our frontends' gauges and planner read.  None
    when the report has no data."""
    data = metrics.get("data")
    if not isinstance(data, dict):
        return None
    kv = data["kv_stats"] if isinstance(data.get("kv_stats"), dict) else data
    ws = data["worker_stats"] if isinstance(data.get("worker_stats"), dict) else data
    used = kv.get("kv_active_blocks")
    if isinstance(used, bool) or not isinstance(used, int):
        used = None
    return _encoder.encode({"worker_id": metrics["worker_id"] & MASK64, "dp_rank": int(ws.get("data_parallel_rank") or 0),
                            "active_decode_blocks": None, "active_prefill_tokens": None, "kv_used_blocks": used,
                            FORWARD_PASS_METRICS: data})


def metrics_from_load(payload: bytes | memoryview) -> dict[str, Any]:
    """A ``kv_metrics`` payload in our load report's shape (what the frontend's worker metrics read): ours
    carry the whole report (``forward_pass_metrics``), 1.x's only ``kv_used_blocks``, read as
    ``kv_stats.kv_active_blocks``.  The worker id as we keep instance ids (i64: one above its maximum comes
    negative, as its key's hex reads).  Raises :class:`EventError` when it is not an ActiveLoad."""
    try:
        load = msgspec.msgpack.decode(payload)
        worker_id = load["worker_id"]
        dp_rank = load.get("dp_rank") or 0
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as e:
        raise EventError(f"not a 1.x ActiveLoad: {e}") from None
    if isinstance(worker_id, int) and worker_id > MASK64 >> 1:  # unsigned on 1.x's wire, i64 where we keep ids
        worker_id -= 1 << 64
    ours = load.get(FORWARD_PASS_METRICS)
    if isinstance(ours, dict):
        return {"worker_id": worker_id, "data": ours}
    kv: dict[str, Any] = {}
    if isinstance(load.get("kv_used_blocks"), int):
        kv["kv_active_blocks"] = load["kv_used_blocks"]
    return {"worker_id": worker_id, "data": {"worker_stats": {"data_parallel_rank": dp_rank}, "kv_stats": kv}}

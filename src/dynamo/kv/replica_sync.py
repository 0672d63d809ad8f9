"""Router replica sync on the wire: what KV routers tell each other about the requests they have in flight,
as topic ``active_sequences_events`` of the workers' endpoint, in Dynamo 1.6.1's own shape so that our
routers and 1.6.1's share their bookings both ways.

Observed from 1.6.1's frontend (``--router-replica-sync``) and mocker, MessagePack in the event plane's
envelope; every payload is an **ActiveSequenceEventBatch**::

    {"events": [{"request_id": str,
                 "worker": {"worker_id": <u64>, "dp_rank": <u32>},
                 "data": {"AddRequest": {"token_sequence": [<u64 sequence hash>...] | null,
                                         "track_prefill_tokens": bool,
                                         "expected_output_tokens": <u32> | null,
                                         "prefill_load_hint": {"initial_effective_prefill_tokens": int,
                                                               "expected_prefill_duration": null} | null}}
                       | "MarkPrefillCompleted" | "Free",
                 "router_id": <u64>,
                 "lora_name": str | null}, ...]}

``token_sequence`` holds the sequence hashes of the prompt's full blocks (the same hashes as ours:
:mod:`dynamo.kv.hashing`), and ``initial_effective_prefill_tokens`` the prompt tokens the router expects the
worker to compute (the prompt less its cached prefix).  A 1.6.1 frontend publishes only with replica sync;
a 1.6.1 worker (its mocker) always publishes ``MarkPrefillCompleted`` for each request it prefilled, with
its own worker id as ``router_id``.  1.6.1 has no heartbeat: a router's bookings end with its ``Free``
events, and its own bound on a booked request's life is 300 s.

What is ours rides in fields 1.6.1 ignores (its decoder skips unknown fields; tested against its
frontend, which logs nothing): ``isl`` in ``AddRequest`` (the prompt length, so a peer of ours books the
private partial last block as we do; its presence also says the router is one of ours, whose bookings end
when its heartbeats stop) and, beside an empty ``events``, the **heartbeat** our routers send every
``peer_ttl / 3`` seconds listing their requests in flight::

    {"events": [], "heartbeat": {"router_id": <u64>, "request_ids": [str...]}}
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

from dynamo.kv.hashing import MASK64

# 1.x's bound on a booked request's life in its router (DEFAULT_ACTIVE_REQUEST_EXPIRY_DURATION): the
# only expiry here of the bookings of a router that sends no heartbeats (1.6.1's)
UNBEATING_BOOKING_S = 300.0
MARK = "MarkPrefillCompleted"
FREE = "Free"


class SeqEvent(NamedTuple):
    """One event of a batch, read: ``kind`` is ``"add"``, ``MARK`` or ``FREE``; ``blocks``, ``isl`` and
    ``prefill`` only for an add (``isl`` None from a 1.x router)."""

    kind: str
    router_id: int
    request_id: str
    worker_id: int  # signed where it is above i64's maximum, as our code keeps worker ids
    blocks: list[int]
    isl: int | None
    prefill: int


def _event(request_id: str, worker_id: int, data: Any, router_id: int, lora_name: str | None) -> dict[str, Any]:
    return {"events": [{"request_id": request_id, "worker": {"worker_id": worker_id & MASK64, "dp_rank": 0},
                        "data": data, "router_id": router_id, "lora_name": lora_name}]}


def add_request(request_id: str, worker_id: int, router_id: int, seq_hashes: Sequence[int], isl: int,
                prefill: int, lora_name: str | None) -> dict[str, Any]:
    """The batch booking ``request_id`` on ``worker_id``: ``seq_hashes`` of its full blocks, ``prefill``
    the prompt tokens the worker has to compute."""
    return _event(request_id, worker_id, {"AddRequest": {
        "token_sequence": seq_hashes, "track_prefill_tokens": True, "expected_output_tokens": None,
        "prefill_load_hint": {"initial_effective_prefill_tokens": prefill, "expected_prefill_duration": None},
        "isl": isl}}, router_id, lora_name)


def mark_prefill_completed(request_id: str, worker_id: int, router_id: int, lora_name: str | None) -> dict[str, Any]:
    return _event(request_id, worker_id, MARK, router_id, lora_name)


def free(request_id: str, worker_id: int, router_id: int, lora_name: str | None) -> dict[str, Any]:
    return _event(request_id, worker_id, FREE, router_id, lora_name)


def heartbeat(router_id: int, request_ids: list[str]) -> dict[str, Any]:
    """Ours: an empty batch (1.6.1 reads nothing in it) carrying the requests ``router_id`` has in flight."""
    return {"events": [], "heartbeat": {"router_id": router_id, "request_ids": request_ids}}


def read_events(batch: dict[str, Any], block_size: int) -> Iterator[SeqEvent]:
    """The events of one batch, in order; raises KeyError, TypeError or ValueError on a malformed one (the
    ones before it are already yielded)."""
    for ev in batch["events"]:
        worker = int(ev["worker"]["worker_id"])
        if worker > MASK64 >> 1:
            worker -= 1 << 64
        data = ev["data"]
        if data == MARK or data == FREE:
            yield SeqEvent(data, int(ev["router_id"]), str(ev["request_id"]), worker, [], None, 0)
            continue
        add = data["AddRequest"]
        blocks = [int(b) for b in add.get("token_sequence") or ()]
        isl = add.get("isl")
        hint = add.get("prefill_load_hint")
        if not add.get("track_prefill_tokens", True):
            prefill = 0
        elif hint is not None:
            prefill = int(hint["initial_effective_prefill_tokens"])
        else:  # (1.x without a hint: the whole prompt, as far as its full blocks tell)
            prefill = len(blocks) * block_size
        yield SeqEvent("add", int(ev["router_id"]), str(ev["request_id"]), worker, blocks,
                       int(isl) if isinstance(isl, int) else None, prefill)


def read_heartbeat(batch: dict[str, Any]) -> tuple[int, set[str]] | None:
    """(router id, its requests in flight) of a heartbeat of ours, None when the batch is not one."""
    beat = batch.get("heartbeat")
    if beat is None:
        return None
    return int(beat["router_id"]), {str(r) for r in beat.get("request_ids") or ()}

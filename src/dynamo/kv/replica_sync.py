"""Router replica sync on the wire: what KV routers tell each other about the requests they have in flight,
as topic ``active_sequences_events`` of the workers' endpoint, in Dynamo 1.6.1's own shape so that our
routers and 1.6.1's share their bookings both ways.

Observed from 1.6.1's frontend (``--router-replica-sync``) and mocker, MessagePack in the event plane's
envelope.  One event is an **ActiveSequenceEvent**::

    {"request_id": str,
     "worker": {"worker_id": <u64>, "dp_rank": <u32>},
     "data": {"AddRequest": {"token_sequence": [<u64 sequence hash>...] | null,
                             "track_prefill_tokens": bool,
                             "expected_output_tokens": <u32> | null,
                             "prefill_load_hint": {"initial_effective_prefill_tokens": int,
                                                   "expected_prefill_duration": null} | null}}
           | "MarkPrefillCompleted" | "Free",
     "router_id": <u64>,
     "lora_name": str | null}

On ZMQ a message is a batch of them, ``{"events": [...]}`` (an ActiveSequenceEventBatch); on NATS a message
is one bare event.  1.6.1 reads only its own transport's framing: a bare event on ZMQ or a batch on NATS is
a warning line per message (``missing field `events```, ``missing field `request_id```), so a publisher
frames by its transport (:func:`frame`) and a reader takes either.

``token_sequence`` holds the sequence hashes of the prompt's full blocks (the same hashes as ours:
:mod:`dynamo.kv.hashing`), and ``initial_effective_prefill_tokens`` the prompt tokens the router expects the
worker to compute (the prompt less its cached prefix).  A 1.6.1 frontend publishes only with replica sync;
a 1.6.1 worker (its mocker) always publishes ``MarkPrefillCompleted`` for each request it prefilled, with
its own id as ``router_id``.  1.6.1 has no heartbeat: a router's bookings end with its ``Free`` events,
and its own bound on a booked request's life is 300 s.

What is ours rides in fields 1.6.1 ignores (its decoder skips unknown fields; tested against its
frontend, which logs nothing): ``isl`` in ``AddRequest`` (the prompt length, so a peer of ours books the
private partial last block as we do; its presence also says the router is one of ours, whose bookings end
when its heartbeats stop), and the **heartbeat** our routers send every ``peer_ttl / 3`` seconds listing
their requests in flight: an event 1.6.1 applies as a no-op (the prefill of request ``""``, which no router
books, is done) with a ``heartbeat`` field::

    {"request_id": "", "worker": {"worker_id": 0, "dp_rank": 0}, "data": "MarkPrefillCompleted",
     "router_id": <u64>, "lora_name": null, "heartbeat": {"request_ids": [str...]}}
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

from dynamo.kv.hashing import MASK64

# 1.x's bound on a booked request's life in its router (DEFAULT_ACTIVE_REQUEST_EXPIRY_DURATION): the
# only expiry here of the bookings of a router that sends no heartbeats (1.6.1's)
UNBEATING_BOOKING_S = 300.0
MARK = "MarkPrefillCompleted"
FREE = "Free"
ADD = "add"
BEAT = "heartbeat"


class SeqEvent(NamedTuple):
    """One event, read: ``kind`` is ADD, MARK, FREE or BEAT; ``blocks``, ``isl`` and ``prefill`` only for an
    add (``isl`` None from a 1.x router), ``live`` (the requests the router has in flight) only for a beat."""

    kind: str
    router_id: int
    request_id: str
    worker_id: int  # signed where it is above i64's maximum, as our code keeps worker ids
    blocks: list[int]
    isl: int | None
    prefill: int
    live: frozenset[str] = frozenset()


def _event(request_id: str, worker_id: int, data: Any, router_id: int, lora_name: str | None) -> dict[str, Any]:
    return {"request_id": request_id, "worker": {"worker_id": worker_id & MASK64, "dp_rank": 0},
            "data": data, "router_id": router_id, "lora_name": lora_name}


def add_request(request_id: str, worker_id: int, router_id: int, seq_hashes: Sequence[int], isl: int,
                prefill: int, lora_name: str | None) -> dict[str, Any]:
    """The event booking ``request_id`` on ``worker_id``: ``seq_hashes`` of its full blocks, ``prefill``
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
    """Ours: a no-op for 1.6.1 carrying the requests ``router_id`` has in flight."""
    event = _event("", 0, MARK, router_id, None)
    event[BEAT] = {"request_ids": request_ids}
    return event


def frame(event: dict[str, Any], transport: str) -> dict[str, Any]:
    """One event as a message on ``transport`` (``zmq``: a batch of one; ``nats``: bare)."""
    return {"events": [event]} if transport == "zmq" else event


def read_events(message: dict[str, Any], block_size: int) -> Iterator[SeqEvent]:
    """The events of one message (a batch or one bare event), in order; raises KeyError, TypeError or
    ValueError on a malformed one (those before it are already yielded)."""
    for ev in message["events"] if "events" in message else (message,):
        router_id, request_id = int(ev["router_id"]), str(ev["request_id"])
        beat = ev.get(BEAT)
        if beat is not None:
            yield SeqEvent(BEAT, router_id, request_id, 0, [], None, 0,
                           frozenset(str(r) for r in beat.get("request_ids") or ()))
            continue
        worker = int(ev["worker"]["worker_id"])
        if worker > MASK64 >> 1:
            worker -= 1 << 64
        data = ev["data"]
        if data == MARK or data == FREE:
            yield SeqEvent(data, router_id, request_id, worker, [], None, 0)
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
        yield SeqEvent(ADD, router_id, request_id, worker, blocks, int(isl) if isinstance(isl, int) else None,
                       prefill)

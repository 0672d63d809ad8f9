"""Reading the fleet's events in tests, as its processes do: Dynamo 1.x's envelopes, MessagePack payloads.

Through a runtime's event plane (:func:`follow`: the publishers found in ``v1/event_channels``), or with a
bare NATS client on the NATS event plane (:func:`nats_subject` and :func:`payload`: the envelope is the
message).  KV events come as arrays of RouterEvents, their worker ids unsigned on the wire: :func:`kv_events`
gives them as our code keeps ids (i64).
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from dynamo.runtime.v1_event_wire import EVENT_CHANNELS, EndpointScope, Envelope, decode_envelope, encode_envelope

__all__ = ["channels", "follow", "kv_events", "nats_subject", "payload", "undecodable_kv_event"]


def nats_subject(namespace: str, topic: str, component: str = "*", endpoint: str = "*") -> str:
    """The NATS subject (a wildcard by default) of ``topic`` in a namespace's endpoints."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.{topic}"


def payload(data: bytes | Envelope) -> Any:
    """What one event carries: a NATS message's data (the envelope) or an envelope, decoded."""
    env = data if isinstance(data, Envelope) else decode_envelope(data)
    return msgspec.msgpack.decode(env.payload)


def kv_events(data: bytes | Envelope) -> list[dict[str, Any]]:
    """The RouterEvents of one ``kv-events`` message, worker ids as we keep them (i64)."""
    events = [e for e in payload(data) if isinstance(e.get("worker_id"), int)]  # (a test's marker is not)
    for e in events:
        if e["worker_id"] >= 1 << 63:
            e["worker_id"] -= 1 << 64
    return events


async def follow(rt: Any, scope: EndpointScope, topic: str, handler: Callable[[Any], None]) -> Any:
    """``handler(payload)`` for each event of ``topic`` in ``scope``, through ``rt``'s event plane (for
    ``kv-events``: once per RouterEvent)."""
    if topic == "kv-events":
        def on_env(env: Envelope) -> None:
            for e in kv_events(env):
                handler(e)
    else:
        def on_env(env: Envelope) -> None:
            handler(payload(env))
    return await rt.event_plane().subscribe(scope, topic, on_env)


async def channels(rt: Any, scope: EndpointScope, *topics: str) -> int:
    """How many publishers of ``topics`` in ``scope`` discovery names now."""
    return sum([len(await rt.discovery().get_prefix(scope.key_prefix(EVENT_CHANNELS, t))) for t in topics])


def undecodable_kv_event(marker: str) -> bytes:
    """A NATS ``kv-events`` message a KV router logs and skips, naming ``marker`` (its worker id): once the
    marker is in a frontend's log, the events it received before were applied."""
    return encode_envelope(1, 0, "kv-events", msgspec.msgpack.encode([{"worker_id": marker}]))

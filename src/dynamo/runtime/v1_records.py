"""Dynamo 1.x's discovery records: the key layout and the JSON values of ``v1/instances``, ``v1/mdc``,
``v1/event_channels`` and ``v1/event_sources``, so that our processes and Dynamo 1.6.1's form one fleet.

A 1.x frontend finds workers only under these keys and in this shape, and a 1.x worker announces itself
only there. A model's only record is the ``v1/mdc`` Model (what 1.x's card has no field for rides in it:
llm/v1_card.py). Instances still have our own record too (``instances/``, which carries the addresses of
our wire): a worker of ours writes both, and a client reads both and prefers ours for an instance that has
both (:mod:`.v1_discovery`). The facts (key shapes, field names and order, ``{id:x}`` lowercase hex without
padding) are what 1.6.1 writes, observed on disk and in etcd; the values here are built from them, not
from 1.x's code.

The ``v1/event_channels`` and ``v1/event_sources`` records are built where the event plane uses them
(:mod:`.v1_event_wire`); only their buckets are named here, for the file store.

Keys are full keys (``v1/instances/ns/comp/ep/59f5a04...``): on etcd exactly that string, under the
writer's lease; on the file store the first two segments are the bucket's directories and the rest one
percent-encoded file name (:mod:`.file_v1`).

Instance ids: 1.x's are random u64; ours are etcd lease ids (positive i64). Everywhere in our code an id
above i64's maximum is kept as its two's-complement negative (as :func:`~.names.parse_lease_hex` reads
a key), so the id from a record's JSON (:func:`signed_id`) and the id from its key agree.
"""

from __future__ import annotations

from typing import Any

import orjson

from .instance import Instance
from .names import EndpointId, lease_hex, parse_lease_hex

INSTANCES = "v1/instances"
MODELS = "v1/mdc"
EVENT_CHANNELS = "v1/event_channels"
EVENT_SOURCES = "v1/event_sources"
BUCKETS = (INSTANCES, MODELS, EVENT_CHANNELS, EVENT_SOURCES)
PREFIX = "v1/"

CODEC = "msgpack"  # the request-plane codec 1.6.1 advertises, and the one a 1.x client speaks to us
DEVICE_TYPE = "cpu"

__all__ = [
    "BUCKETS", "CODEC", "EVENT_CHANNELS", "EVENT_SOURCES", "INSTANCES", "MODELS", "PREFIX",
    "endpoint_key", "endpoint_record", "instance_from_record", "instances_prefix", "model_key", "model_record", "models_prefix", "our_instance_key",
    "signed_id", "tcp_transport", "translate_instance", "u64_id",
]


def u64_id(instance_id: int) -> int:
    """An instance id as 1.x writes it in JSON: unsigned 64-bit."""
    return instance_id & 0xFFFF_FFFF_FFFF_FFFF


def signed_id(instance_id: int) -> int:
    """An instance id as our code keeps it: ids above i64's maximum as their negative (what the key's hex
    gives through :func:`~.names.parse_lease_hex`)."""
    return parse_lease_hex(lease_hex(instance_id))


def _dumps(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record)  # compact, fields in insertion order: as 1.6.1 writes them


# ---------------------------------------------------------------------------------------- keys

def endpoint_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """``v1/instances/{ns}/{comp}/{ep}/{id:x}``."""
    return f"{INSTANCES}/{namespace}/{component}/{endpoint}/{lease_hex(instance_id)}"


def instances_prefix(endpoint: EndpointId) -> str:
    """The prefix every ``v1/instances`` key of one endpoint starts with (the slash keeps ``gen`` from
    matching ``generate``)."""
    return f"{INSTANCES}/{endpoint.namespace}/{endpoint.component}/{endpoint.name}/"


def model_key(namespace: str, component: str, endpoint: str, instance_id: int, lora_suffix: str | None = None) -> str:
    """``v1/mdc/{ns}/{comp}/{ep}/{id:x}[/{lora_suffix}]``."""
    key = f"{MODELS}/{namespace}/{component}/{endpoint}/{lease_hex(instance_id)}"
    return f"{key}/{lora_suffix}" if lora_suffix else key


def models_prefix(namespace: str | None = None) -> str:
    return f"{MODELS}/{namespace}/" if namespace else f"{MODELS}/"


def our_instance_key(v1_key: str) -> str | None:
    """``v1/instances/ns/comp/ep/{id:x}`` -> our ``instances/ns/comp/ep:{id:x}`` (None: not such a key)."""
    parts = v1_key.split("/")
    if len(parts) != 6 or f"{parts[0]}/{parts[1]}" != INSTANCES:
        return None
    _, _, ns, comp, ep, hexid = parts
    try:
        parse_lease_hex(hexid)
    except ValueError:
        return None
    return EndpointId(ns, comp, ep).instance_key(parse_lease_hex(hexid))


# ---------------------------------------------------------------------------------------- values

def tcp_transport(hostport: str, instance_id: int, namespace: str, component: str, endpoint: str) -> str:
    """A 1.x TCP address: ``host:port/{id:x}/{ns}/{comp}/{ep}``; the part after ``host:port/`` is the path
    a 1.x client sends in each request."""
    return f"{hostport}/{lease_hex(instance_id)}/{namespace}/{component}/{endpoint}"


def endpoint_record(namespace: str, component: str, endpoint: str, instance_id: int, hostport: str, *,
                    device_type: str = DEVICE_TYPE, codec: str = CODEC) -> bytes:
    """The ``Endpoint`` value of a ``v1/instances`` key: an endpoint served over TCP at ``hostport``."""
    return _dumps({
        "type": "Endpoint", "component": component, "endpoint": endpoint, "namespace": namespace,
        "instance_id": u64_id(instance_id),
        "transport": {"tcp": tcp_transport(hostport, instance_id, namespace, component, endpoint)},
        "device_type": device_type, "request_plane_codec": codec,
    })


def model_record(namespace: str, component: str, endpoint: str, instance_id: int, card_json: dict[str, Any],
                 model_suffix: str | None = None) -> bytes:
    """The ``Model`` value of a ``v1/mdc`` key: the model card (``card_json``, llm/v1_card.py builds it)."""
    record: dict[str, Any] = {"type": "Model", "namespace": namespace, "component": component,
                              "endpoint": endpoint, "instance_id": u64_id(instance_id), "card_json": card_json}
    if model_suffix:
        record["model_suffix"] = model_suffix
    return _dumps(record)


# ---------------------------------------------------------------------------------------- reading

def instance_from_record(raw: bytes | str) -> Instance:
    """Our :class:`Instance` of a 1.x ``Endpoint`` record: ``subject`` is its TCP transport string as
    written (``host:port/{id:x}/ns/comp/ep``, the shape that tells a client to speak 1.x's wire), the id
    kept signed (:func:`signed_id`). Raises ValueError for another record type or a transport we cannot
    reach (1.x's ``nats_tcp`` and ``http`` transports)."""
    obj = orjson.loads(raw)
    if not isinstance(obj, dict) or obj.get("type") != "Endpoint":
        raise ValueError(f"not an Endpoint record (type {obj.get('type') if isinstance(obj, dict) else None!r})")
    transport = obj.get("transport") or {}
    address = transport.get("tcp") if isinstance(transport, dict) else None
    if not isinstance(address, str) or not address:
        kinds = ", ".join(transport) if isinstance(transport, dict) else repr(transport)
        raise ValueError(f"transport {kinds or 'none'} is not TCP (only 1.x workers on the TCP request plane "
                         "can be reached)")
    return Instance(obj["namespace"], obj["component"], obj["endpoint"], signed_id(int(obj["instance_id"])),
                    address, obj.get("request_plane_codec") or CODEC)


def translate_instance(key: str, value: bytes) -> tuple[str, bytes]:
    """A ``v1/instances`` key and value as our ``instances/`` key and Instance JSON (what a
    :class:`~.client.Client` follows). Raises ValueError for a record that is not a reachable endpoint."""
    ours = our_instance_key(key)
    if ours is None:
        raise ValueError(f"not a v1/instances key: {key!r}")
    return ours, instance_from_record(value).to_json()

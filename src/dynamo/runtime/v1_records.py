"""Dynamo 1.x's discovery records, the only ones of the fleet: the key layout of ``v1/instances``,
``v1/mdc``, ``v1/event_channels`` and ``v1/event_sources``, and the ``Model`` value, so that our processes
and Dynamo 1.6.1's form one fleet (the ``Endpoint`` value is an Instance's JSON: instance.py).

A 1.x frontend finds workers only under these keys and in this shape, and a 1.x worker announces itself
only there; ours write and read nothing else. What 1.x has no field for rides in extra fields 1.6.1
ignores: our card in the Model's ``card_json`` (llm/v1_card.py), "served by us" in the Endpoint
(instance.py). The facts (key shapes, field names and order, ``{id:x}`` lowercase hex without
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

from .names import INSTANCE_ROOT, EndpointId, lease_hex, signed_id, u64_id

INSTANCES = INSTANCE_ROOT
MODELS = "v1/mdc"
EVENT_CHANNELS = "v1/event_channels"
EVENT_SOURCES = "v1/event_sources"
BUCKETS = (INSTANCES, MODELS, EVENT_CHANNELS, EVENT_SOURCES)
PREFIX = "v1/"

__all__ = [
    "BUCKETS", "EVENT_CHANNELS", "EVENT_SOURCES", "INSTANCES", "MODELS", "PREFIX",
    "endpoint_key", "instances_prefix", "model_key", "model_record", "models_prefix", "signed_id", "u64_id",
]


def _dumps(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record)  # compact, fields in insertion order: as 1.6.1 writes them


# ---------------------------------------------------------------------------------------- keys

def endpoint_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """``v1/instances/{ns}/{comp}/{ep}/{id:x}``."""
    return EndpointId(namespace, component, endpoint).instance_key(instance_id)


def instances_prefix(endpoint: EndpointId) -> str:
    """The prefix every ``v1/instances`` key of one endpoint starts with (the slash keeps ``gen`` from
    matching ``generate``)."""
    return f"{endpoint.etcd_prefix}/"


def model_key(namespace: str, component: str, endpoint: str, instance_id: int, lora_suffix: str | None = None) -> str:
    """``v1/mdc/{ns}/{comp}/{ep}/{id:x}[/{lora_suffix}]``."""
    key = f"{MODELS}/{namespace}/{component}/{endpoint}/{lease_hex(instance_id)}"
    return f"{key}/{lora_suffix}" if lora_suffix else key


def models_prefix(namespace: str | None = None) -> str:
    return f"{MODELS}/{namespace}/" if namespace else f"{MODELS}/"


# ---------------------------------------------------------------------------------------- values

def model_record(namespace: str, component: str, endpoint: str, instance_id: int, card_json: dict[str, Any],
                 model_suffix: str | None = None) -> bytes:
    """The ``Model`` value of a ``v1/mdc`` key: the model card (``card_json``, llm/v1_card.py builds it)."""
    record: dict[str, Any] = {"type": "Model", "namespace": namespace, "component": component,
                              "endpoint": endpoint, "instance_id": u64_id(instance_id), "card_json": card_json}
    if model_suffix:
        record["model_suffix"] = model_suffix
    return _dumps(record)

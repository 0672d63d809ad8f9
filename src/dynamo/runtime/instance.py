"""An instance of an endpoint, and its one discovery record: Dynamo 1.x's ``Endpoint`` under
``v1/instances/{ns}/{comp}/{ep}/{id:x}``, so that our processes and 1.6.1's find each other's workers
with nothing to translate.

The record, as 1.6.1 writes it (field order, compact JSON, ``instance_id`` a u64):
``{"type":"Endpoint","component","endpoint","namespace","instance_id","transport":{...},"device_type","request_plane_codec"}``.
``transport`` is ``{"tcp": "host:port/{id:x}/{ns}/{comp}/{ep}"}`` for an endpoint on the TCP request plane
and ``{"nats_tcp": subject}`` for one served over NATS (1.x's two variants for them); 1.x's third,
``http``, is one we cannot reach, refused when read. Ids above i64's maximum are kept negative in our
code (:func:`~.names.signed_id`), so the id from a record's JSON and the id from its key agree."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .names import EndpointId, is_v1_tcp_address, signed_id, u64_id

CODEC = "msgpack"  # the request-plane codec 1.6.1 advertises, and the one a 1.x client speaks to us
DEVICE_TYPE = "cpu"
OURS = "dynamo_py"  # the Endpoint record's extra field: true when the endpoint is served by a process of ours


@dataclass(frozen=True, slots=True)
class Instance:
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    # its address on the request plane: a TCP address ``host:port/{id:x}/{ns}/{comp}/{ep}`` (stored as
    # transport.tcp) or a NATS subject (transport.nats_tcp)
    subject: str
    request_plane_codec: str = CODEC
    device_type: str = DEVICE_TYPE
    # served by a process of ours (the record's extra field OURS, which 1.6.1 ignores); False: a Dynamo 1.x
    # worker, to which what it would ignore is not sent (llm/protocols/wire.py, PeerRequest)
    ours: bool = True

    @classmethod
    def for_endpoint(cls, endpoint: EndpointId, lease_id: int, address: str | None = None) -> "Instance":
        return cls(endpoint.namespace, endpoint.component, endpoint.name, lease_id,
                   address or endpoint.subject(lease_id))

    def to_json(self) -> bytes:
        """The ``Endpoint`` record, byte for byte as 1.6.1 writes one (ours with :data:`OURS` after its fields)."""
        transport = "tcp" if is_v1_tcp_address(self.subject) else "nats_tcp"
        return orjson.dumps({
            "type": "Endpoint", "component": self.component, "endpoint": self.endpoint, "namespace": self.namespace,
            "instance_id": u64_id(self.instance_id), "transport": {transport: self.subject},
            "device_type": self.device_type, "request_plane_codec": self.request_plane_codec,
            **({OURS: True} if self.ours else {}),
        })

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Instance":
        """The instance of an ``Endpoint`` record (ours or 1.x's). ValueError for another record type or a
        transport we cannot reach (1.x's ``http``)."""
        obj = orjson.loads(raw)
        if not isinstance(obj, dict) or obj.get("type") != "Endpoint":
            raise ValueError(f"not an Endpoint record (type {obj.get('type') if isinstance(obj, dict) else None!r})")
        transport = obj.get("transport") or {}
        address = None
        if isinstance(transport, dict):
            address = transport.get("tcp") or transport.get("nats_tcp")
        if not isinstance(address, str) or not address:
            kinds = ", ".join(transport) if isinstance(transport, dict) else repr(transport)
            raise ValueError(f"transport {kinds or 'none'} cannot be reached (only TCP and NATS endpoints can)")
        return cls(obj["namespace"], obj["component"], obj["endpoint"], signed_id(int(obj["instance_id"])),
                   address, obj.get("request_plane_codec") or CODEC, obj.get("device_type") or DEVICE_TYPE,
                   obj.get(OURS) is True)

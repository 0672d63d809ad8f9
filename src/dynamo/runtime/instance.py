"""The Instance record stored under ``instances/<ns>/<comp>/<ep>:<lease_hex>``, in the original's
JSON shape, so clients of either implementation find workers of the other.

A Dynamo 1.x worker (no record of ours, only ``v1/instances``: runtime/v1_records.py) becomes an
Instance too: its ``subject`` is the 1.x transport string ``host:port/{id:x}/{ns}/{comp}/{ep}``, kept
as 1.x writes it, and ``request_plane_codec`` the codec it names ("msgpack"); that address shape
(:func:`~dynamo.runtime.names.is_v1_tcp_address`) is what tells a client to speak 1.x's TCP wire."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .names import EndpointId, is_v1_tcp_address


@dataclass(frozen=True, slots=True)
class Instance:
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    # its address on the request plane: a NATS subject (stored as transport.nats_tcp, the original's
    # field) or a TCP address ``tcp://host:port/<service>.<endpoint>`` (stored as transport.tcp)
    subject: str
    # a 1.x worker's request-plane codec ("msgpack"); None for ours (the field is then not written)
    request_plane_codec: str | None = None

    @classmethod
    def for_endpoint(cls, endpoint: EndpointId, lease_id: int, address: str | None = None) -> "Instance":
        return cls(endpoint.namespace, endpoint.component, endpoint.name, lease_id,
                   address or endpoint.subject(lease_id))

    def to_json(self) -> bytes:
        """Pretty JSON in the original's field order."""
        tcp = self.subject.startswith("tcp://") or is_v1_tcp_address(self.subject)
        record = {
            "component": self.component,
            "endpoint": self.endpoint,
            "namespace": self.namespace,
            "instance_id": self.instance_id,
            "transport": {"tcp" if tcp else "nats_tcp": self.subject},
        }
        if self.request_plane_codec is not None:
            record["request_plane_codec"] = self.request_plane_codec
        return orjson.dumps(record, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Instance":
        obj = orjson.loads(raw)
        transport = obj.get("transport") or {}
        return cls(obj["namespace"], obj["component"], obj["endpoint"], int(obj["instance_id"]),
                   transport.get("nats_tcp") or transport.get("tcp") or "", obj.get("request_plane_codec"))

"""The Instance record stored under ``instances/<ns>/<comp>/<ep>:<lease_hex>``, in the original's
JSON shape, so clients of either implementation find workers of the other."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .names import EndpointId


@dataclass(frozen=True, slots=True)
class Instance:
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    # its address on the request plane: a NATS subject (stored as transport.nats_tcp, the original's
    # field) or a TCP address ``tcp://host:port/<service>.<endpoint>`` (stored as transport.tcp)
    subject: str

    @classmethod
    def for_endpoint(cls, endpoint: EndpointId, lease_id: int, address: str | None = None) -> "Instance":
        return cls(endpoint.namespace, endpoint.component, endpoint.name, lease_id,
                   address or endpoint.subject(lease_id))

    def to_json(self) -> bytes:
        """Pretty JSON in the original's field order."""
        return orjson.dumps(
            {
                "component": self.component,
                "endpoint": self.endpoint,
                "namespace": self.namespace,
                "instance_id": self.instance_id,
                "transport": {"tcp" if self.subject.startswith("tcp://") else "nats_tcp": self.subject},
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Instance":
        obj = orjson.loads(raw)
        transport = obj.get("transport") or {}
        return cls(obj["namespace"], obj["component"], obj["endpoint"], int(obj["instance_id"]),
                   transport.get("nats_tcp") or transport.get("tcp") or "")

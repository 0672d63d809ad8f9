"""Names on the network: ``dyn://namespace.component.endpoint`` parsing, slugs, keys and subjects.

Everything here is pure string work so that the etcd key layout and NATS subjects (the original's, so the two
interoperate) are decided in one place and can be unit-tested without servers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "NS"
DEFAULT_COMPONENT = "C"
DEFAULT_ENDPOINT = "E"
DYN_SCHEME = "dyn://"
INSTANCE_ROOT = "v1/instances"  # Dynamo 1.x's bucket of Endpoint records: every instance's only record

_SLUG_BAD = re.compile(r"[^a-z0-9_-]")
# an endpoint's TCP address, ours and Dynamo 1.x's: ``host:port/{instance_id:x}/{ns}/{comp}/{ep}``
_V1_TCP_ADDRESS = re.compile(r"^[^/\s]+:\d+/[0-9a-f]+/[^/]+/[^/]+/[^/]+$")
_SPLIT = re.compile(r"[./]")


def slugify(name: str) -> str:
    """Lowercase, map every char outside ``[a-z0-9_-]`` to ``_``, strip leading ``_``.

    ``Qwen/Qwen3-0.6B`` -> ``qwen_qwen3-0_6b``. Used for NATS service names and model keys.
    """
    return _SLUG_BAD.sub("_", name.lower()).lstrip("_")


def lease_hex(lease_id: int) -> str:
    """Instance id as shown in keys and subjects: lowercase hex, no ``0x``, two's complement if negative."""
    return format(lease_id & 0xFFFF_FFFF_FFFF_FFFF, "x")


def is_v1_tcp_address(address: str) -> bool:
    """Whether an instance's address is a TCP endpoint, ``host:port/{id:x}/{ns}/{comp}/{ep}`` (the ``tcp``
    value of a ``v1/instances`` record, ours and 1.x's alike): it is sent to over the TCP request plane.
    NATS subjects have no ``:port/``."""
    return bool(_V1_TCP_ADDRESS.match(address))


def u64_id(instance_id: int) -> int:
    """An instance id as Dynamo 1.x writes it in JSON: unsigned 64-bit."""
    return instance_id & 0xFFFF_FFFF_FFFF_FFFF


def signed_id(instance_id: int) -> int:
    """An instance id as our code keeps it: ids above i64's maximum as their negative (what a key's hex
    gives through :func:`parse_lease_hex`)."""
    return parse_lease_hex(lease_hex(instance_id))


def parse_lease_hex(text: str) -> int:
    """Inverse of :func:`lease_hex` (ids above i64 max come back negative, as etcd's i64 would be)."""
    value = int(text, 16)
    return value - (1 << 64) if value >= (1 << 63) else value


@dataclass(frozen=True, slots=True)
class EndpointId:
    """Identity of an endpoint: the triple every instance of it shares."""

    namespace: str = DEFAULT_NAMESPACE
    component: str = DEFAULT_COMPONENT
    name: str = DEFAULT_ENDPOINT

    @classmethod
    def parse(cls, text: str) -> "EndpointId":
        """Parse ``[dyn://]ns.comp.ep`` (``.`` or ``/`` separated) with the original's defaulting rules.

        1 part -> component; 2 -> namespace, component; 3 -> all; more -> the tail joined with ``_``
        becomes the endpoint. Empty parts are dropped.
        """
        if text.startswith(DYN_SCHEME):
            text = text[len(DYN_SCHEME):]
        parts = [p for p in _SPLIT.split(text.strip("./")) if p]
        if not parts:
            return cls()
        if len(parts) == 1:
            return cls(component=parts[0])
        if len(parts) == 2:
            return cls(namespace=parts[0], component=parts[1])
        return cls(parts[0], parts[1], "_".join(parts[2:]))

    @property
    def service_name(self) -> str:
        """NATS micro service name of the component: ``slug(<ns>_<comp>)``."""
        return component_service_name(self.namespace, self.component)

    @property
    def etcd_prefix(self) -> str:
        """``v1/instances/{ns}/{comp}/{ep}``: every instance key of this endpoint is below it (after a slash,
        which keeps ``gen`` from matching ``generate``)."""
        return f"{INSTANCE_ROOT}/{self.namespace}/{self.component}/{self.name}"

    def instance_key(self, lease_id: int) -> str:
        """``v1/instances/{ns}/{comp}/{ep}/{id:x}``, the key of one instance's Endpoint record."""
        return f"{self.etcd_prefix}/{lease_hex(lease_id)}"

    def subject(self, lease_id: int | None) -> str:
        """Request subject of one instance; static workers (lease None or 0) use ``<service>.<ep>``."""
        if not lease_id:
            return f"{self.service_name}.{self.name}"
        return f"{self.service_name}.{self.name}-{lease_hex(lease_id)}"

    def endpoint_name(self, lease_id: int | None) -> str:
        """Name of the NATS micro endpoint inside the service group (subject minus the service)."""
        return self.name if not lease_id else f"{self.name}-{lease_hex(lease_id)}"

    def __str__(self) -> str:
        return f"{DYN_SCHEME}{self.namespace}.{self.component}.{self.name}"


def component_service_name(namespace: str, component: str) -> str:
    return slugify(f"{namespace}_{component}")


def component_event_subject(namespace: str, component: str, event: str) -> str:
    """Plain pub/sub subject for component events such as ``kv_events`` (the original's layout)."""
    return f"namespace.{namespace}.component.{component}.{event}"


def namespace_event_subject(namespace: str, event: str) -> str:
    """Plain pub/sub subject for namespace events such as ``kv-hit-rate`` (the original's layout)."""
    return f"namespace.{namespace}.{event}"

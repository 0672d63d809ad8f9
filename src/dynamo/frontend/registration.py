"""A frontend's own entry in discovery, so that whoever watches the fleet's load (the planner) finds it.

An HTTP frontend (``in=http out=dyn``) writes one key bound to its lease once it listens::

    frontends/<instance id, hex>   {"url": "http://10.0.0.5:8000", "metrics_url": "http://10.0.0.5:8000/metrics",
                                    "instance_id": 7587..., "http_worker": null}

The key lives exactly as long as the frontend: it is deleted on a clean stop, and a frontend killed
with SIGKILL loses it when its lease expires (``DYN_LEASE_TTL``).  A lease restored after an outage
writes it again (it is a primary-lease key of the runtime's store).  With ``--http-workers N`` each
process has its own lease and key, all with the port's one URL (a scrape is answered by one of them;
each sample says which, with its ``http_worker`` label).

The URL's host is ``--http-host`` unless that is a wildcard (``0.0.0.0``, ``::``, empty); then
``DYN_HTTP_ADVERTISE_HOST`` if set, else the address this host's name resolves to, else loopback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from dynamo.runtime.names import lease_hex
from dynamo.runtime.tcp import advertise_host

if TYPE_CHECKING:
    from dynamo.runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

FRONTENDS_PREFIX = "frontends/"
WILDCARD_HOSTS = frozenset(("", "0.0.0.0", "::", "[::]"))


@dataclass(frozen=True, slots=True)
class FrontendEntry:
    url: str
    instance_id: int
    http_worker: int | None = None

    @property
    def metrics_url(self) -> str:
        return self.url.rstrip("/") + "/metrics"

    def key(self) -> str:
        return f"{FRONTENDS_PREFIX}{lease_hex(self.instance_id)}"

    def to_json(self) -> bytes:
        return orjson.dumps({"url": self.url, "metrics_url": self.metrics_url, "instance_id": self.instance_id,
                             "http_worker": self.http_worker})

    @classmethod
    def from_json(cls, data: bytes | str) -> "FrontendEntry":
        """Raises ValueError (or KeyError, TypeError) for an entry that is not one."""
        value = orjson.loads(data)
        url = value["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) URL: {url!r}")
        worker = value.get("http_worker")
        return cls(url=url, instance_id=int(value["instance_id"]), http_worker=None if worker is None else int(worker))


def advertised_url(scheme: str, host: str, port: int) -> str:
    """The URL others reach this frontend at (see the module docstring for the host)."""
    if host in WILDCARD_HOSTS:
        host = advertise_host(os.environ.get("DYN_HTTP_ADVERTISE_HOST"))
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


async def register_frontend(runtime: DistributedRuntime, url: str, http_worker: int | None = None) -> FrontendEntry:
    """Write this frontend's entry under the runtime's primary lease."""
    entry = FrontendEntry(url=url, instance_id=runtime.primary_lease_id, http_worker=http_worker)
    await runtime.discovery().put(entry.key(), entry.to_json(), lease=True)
    log.debug("registered frontend %s as %s", url, entry.key())
    return entry


async def deregister_frontend(runtime: DistributedRuntime, entry: FrontendEntry) -> None:
    """Delete the entry (a clean stop: watchers stop scraping at once); best effort."""
    try:
        await runtime.discovery().delete(entry.key())
    except Exception as e:  # noqa: BLE001 - the lease's revocation removes it anyway
        log.debug("could not delete %s: %s", entry.key(), e)

"""The primary lease (on any :class:`~dynamo.runtime.discovery.Discovery` store): granted at start-up,
refreshed every TTL/3, revoked at shutdown.

Its id is the process's instance id: it is in the instance keys and the NATS subjects. Every key written
with it (instance records, model entries) disappears when the process dies (after the TTL) or shuts
down (at once, by revocation).

etcd being unreachable is not a reason to stop serving: NATS still carries requests, and frontends keep
routing to the instances they know. So the keeper never gives up. While etcd cannot be reached it
retries with backoff (at most TTL/3 apart, so a returning etcd, which restarts leases with a fresh TTL,
is refreshed before they expire). When etcd answers that it does not know the lease (it expired during
a partition, or etcd was wiped or restored from an older snapshot) the keeper grants it again **with
the same id**, so the instance id, subjects and keys stay what they were, and asks its owner to
re-publish the keys bound to it (``on_restored``). After any outage, or when the store revision went
backwards, the owner is asked to check its keys too: a restored snapshot may hold the lease but not
every key. The outage itself is logged by the etcd client (one warning, one info line when it ends);
the keeper adds an info line when it had to grant the lease again or re-publish keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from dynamo.aio import cancel_and_wait

from .backoff import backoff_delays
from .discovery import Discovery
from .errors import DynamoRuntimeError, RuntimeConnectionError

log = logging.getLogger(__name__)

# called with the reason ("re-granted" or "verify"); re-publishes every key bound to the lease
Restorer = Callable[[str], Awaitable[int]]


class LeaseKeeper:
    RETRY_FIRST = 0.25
    RETRY_CAP = 2.0

    def __init__(self, client: Discovery, ttl: int, on_restored: Restorer | None = None) -> None:
        self.client = client
        self.ttl = ttl
        self.on_restored = on_restored
        self.lease_id = 0
        self.regrants = 0  # how many times the lease had to be granted again (diagnostics, tests)
        self._task: asyncio.Task | None = None
        self._revoked = False

    async def start(self) -> int:
        self.lease_id = await self.client.grant_lease(self.ttl)
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="etcd-lease-keepalive")
        return self.lease_id

    async def _keep_alive(self) -> None:
        period = max(self.ttl / 3.0, 0.2)
        cap = min(self.RETRY_CAP, period)
        interval = period
        delays = backoff_delays(self.RETRY_FIRST, cap)
        failing_since: float | None = None
        failing_loudly = False
        last_revision = 0
        while not self._revoked:
            await asyncio.sleep(interval)
            try:
                ttl, revision = await self.client.keep_alive(self.lease_id)
                if ttl <= 0:
                    await self._regrant()
                    await self._restore("re-granted")
                elif failing_since is not None or revision < last_revision:
                    if revision < last_revision:
                        log.warning("etcd revision went backwards (%d -> %d): checking the keys of lease %x",
                                    last_revision, revision, self.lease_id)
                    await self._restore("verify")
                last_revision = revision
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down, slow or refusing: keep serving, retry
                # an unreachable etcd is logged once by the client (warning, then info when it is back)
                loud = failing_since is None and not isinstance(exc, RuntimeConnectionError)
                if failing_since is None:
                    failing_since = time.monotonic()
                    failing_loudly = loud
                (log.warning if loud else log.debug)(
                    "lease %x: keep-alive failed (%s); still serving, retrying with backoff", self.lease_id, exc)
                interval = next(delays)
                continue
            if failing_since is not None:
                (log.info if failing_loudly else log.debug)(
                    "lease %x: keep-alive works again after %.1fs", self.lease_id, time.monotonic() - failing_since)
                failing_since = None
            interval = period
            delays = backoff_delays(self.RETRY_FIRST, cap)

    async def _regrant(self) -> None:
        """Take the same lease id again (etcd forgot it); keys and subjects stay valid."""
        if self._revoked:
            return
        granted = await self.client.grant_lease(self.ttl, self.lease_id)
        if granted != self.lease_id:  # etcd ignoring the requested id would break every key and subject
            raise DynamoRuntimeError(f"etcd granted lease {granted:x} instead of {self.lease_id:x}")
        self.regrants += 1
        log.info("lease %x was gone from etcd (expired, or etcd wiped/restored): granted again with the same id",
                 self.lease_id)

    async def _restore(self, reason: str) -> None:
        if self.on_restored is not None and not self._revoked:
            written = await self.on_restored(reason)
            if written:
                log.info("lease %x: re-published %d key(s)", self.lease_id, written)

    async def revoke(self) -> None:
        """Stop refreshing and revoke (deleting every key bound to the lease)."""
        if self._revoked:
            return
        self._revoked = True
        await self.stop()
        if self.lease_id:
            await self.client.revoke_lease(self.lease_id)

    async def stop(self) -> None:
        """Stop refreshing (the lease then expires on its own after the TTL)."""
        await cancel_and_wait(self._task)
        self._task = None

"""The primary lease: granted at start-up, refreshed every TTL/3, revoked at shutdown.

Its id is the process's instance id. Every key written with it (instance records, model entries)
disappears when the process dies (after the TTL) or shuts down (at once, by revocation). If refreshes
keep failing until the lease would have expired, the owner is told (``on_lost``) so it can stop serving:
clients can no longer find it anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from dynamo.aio import cancel_and_wait
from .etcd import EtcdClient

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, client: EtcdClient, ttl: int, on_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.ttl = ttl
        self.on_lost = on_lost
        self.lease_id = 0
        self._task: asyncio.Task | None = None
        self._revoked = False

    async def start(self) -> int:
        self.lease_id = await self.client.grant_lease(self.ttl)
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="etcd-lease-keepalive")
        return self.lease_id

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3.0, 0.5)
        deadline = time.monotonic() + self.ttl
        while True:
            await asyncio.sleep(interval)
            try:
                ttl = await self.client.keep_alive_once(self.lease_id)
            except Exception as exc:  # noqa: BLE001 - etcd down or slow: retry until the deadline
                log.warning("lease keep-alive failed: %s", exc)
                if time.monotonic() >= deadline:
                    break
                interval = 1.0
                continue
            if ttl <= 0:
                log.error("lease %x is gone (expired or revoked)", self.lease_id)
                break
            deadline = time.monotonic() + ttl
            interval = max(self.ttl / 3.0, 0.5)
        if not self._revoked and self.on_lost is not None:
            self.on_lost()

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

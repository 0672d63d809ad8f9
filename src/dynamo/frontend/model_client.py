"""One model's workers across every endpoint that serves it.

A model name may be registered by workers on more than one endpoint (``dyn://ns.a.generate`` and
``dyn://ns.b.generate``, e.g. two pools or a migration between deployments). The frontend serves that
name from the **union** of their live instances: :class:`ModelClient` looks like one runtime
:class:`~dynamo.runtime.Client` to the routers (``instance_ids``, ``round_robin``, ``random``,
``direct``, ``wait_for_instances``) and hands each request to the endpoint client that owns the chosen
instance. With a single endpoint (the usual case) it simply delegates, so behaviour is unchanged.

A LoRA adapter's model is served only by the workers that announced it (their own model entry for the
adapter): ``only`` is then the set of those instance ids, and every choice is made among them.
"""

from __future__ import annotations

import asyncio
import random as _random
from typing import Any

from dynamo.runtime import Client, Context, ResponseStream


class ModelClient:
    def __init__(self, clients: list[Client] | None = None) -> None:
        self._clients: list[Client] = list(clients or [])
        self._counter = 0
        self.only: set[int] | None = None  # when set: the instances that may serve (a LoRA adapter's)

    # -- membership ------------------------------------------------------------------------------

    @property
    def clients(self) -> list[Client]:
        return list(self._clients)

    def add(self, client: Client) -> None:
        if client not in self._clients:
            self._clients.append(client)

    def remove(self, client: Client) -> None:
        if client in self._clients and len(self._clients) > 1:  # keep one: requests still need a home
            self._clients.remove(client)

    @property
    def endpoint_id(self) -> Any:
        return self._clients[0].endpoint_id

    # -- instances -------------------------------------------------------------------------------

    def instance_ids(self) -> list[int]:
        if self.only is not None:
            return [i for i in self._all_ids() if i in self.only]
        return self._all_ids()

    def _all_ids(self) -> list[int]:
        if len(self._clients) == 1:
            return self._clients[0].instance_ids()
        ids: set[int] = set()
        for client in self._clients:
            ids.update(client.instance_ids())
        return sorted(ids)

    def free_instance_ids(self) -> list[int]:
        """Live instances below their limit of requests in flight (see Client.free_instance_ids)."""
        if len(self._clients) == 1:
            free = self._clients[0].free_instance_ids()
        else:
            ids: set[int] = set()
            for client in self._clients:
                ids.update(client.free_instance_ids())
            free = sorted(ids)
        return free if self.only is None else [i for i in free if i in self.only]

    def must_wait(self) -> bool:
        """Whether :meth:`wait_for_capacity` would queue a caller now (Client.must_wait)."""
        if len(self._clients) == 1:
            return self._clients[0].must_wait()
        return bool(self.instance_ids()) and not self.free_instance_ids()

    def queued(self) -> int:
        """Callers waiting for capacity now (a waiter waits in every endpoint's queue: the longest)."""
        return max((c.queued() for c in self._clients), default=0)

    async def wait_for_capacity(self, deadline: float, max_waiters: int) -> bool:
        """Wait until some endpoint has an instance with room (Client.wait_for_capacity); with several
        endpoints, in each endpoint's queue at once, and the first to have room wins."""
        if len(self._clients) == 1:
            return await self._clients[0].wait_for_capacity(deadline, max_waiters)
        if self.free_instance_ids() or not self.instance_ids():
            return True
        waiters = [asyncio.ensure_future(c.wait_for_capacity(deadline, max_waiters)) for c in self._clients]
        try:
            pending = set(waiters)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not w.cancelled() and w.exception() is None and w.result() for w in done):
                    return True
            return False
        finally:
            for w in waiters:
                w.cancel()  # a waiter woken but not used passes its wake-up on

    def instances(self) -> list[Any]:
        return [inst for client in self._clients for inst in client.instances()]

    def report_instance_down(self, instance_id: int) -> None:
        for client in self._clients:
            client.report_instance_down(instance_id)

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        """Wait until some endpoint has an instance; asyncio.TimeoutError after ``timeout``."""
        if len(self._clients) == 1:
            return await self._clients[0].wait_for_instances(timeout)
        if self.instance_ids():
            return self.instance_ids()
        waiters = [asyncio.ensure_future(c.wait_for_instances()) for c in self._clients]
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not done:
            raise asyncio.TimeoutError
        return self.instance_ids()

    def _owner(self, instance_id: int) -> Client:
        for client in self._clients:
            if instance_id in client.instance_ids():
                return client
        return self._clients[0]  # unknown id: that client raises InstanceNotFoundError

    # -- routing ---------------------------------------------------------------------------------

    def direct(self, request: Any, instance_id: int, *, context: Context | None = None,
               annotated: bool = False, lazy: bool = False) -> ResponseStream:
        return self._owner(instance_id).direct(request, instance_id, context=context, annotated=annotated,
                                               lazy=lazy)

    def round_robin(self, request: Any, *, context: Context | None = None, annotated: bool = False,
                    lazy: bool = False) -> ResponseStream:
        if len(self._clients) == 1 and self.only is None:
            return self._clients[0].round_robin(request, context=context, annotated=annotated, lazy=lazy)
        ids = self.free_instance_ids() or self.instance_ids()
        if not ids:  # let the first client raise NoInstancesError
            return self._clients[0].round_robin(request, context=context, annotated=annotated, lazy=lazy)
        chosen = ids[self._counter % len(ids)]
        self._counter += 1
        return self.direct(request, chosen, context=context, annotated=annotated, lazy=lazy)

    def random(self, request: Any, *, context: Context | None = None, annotated: bool = False,
               lazy: bool = False) -> ResponseStream:
        if len(self._clients) == 1 and self.only is None:
            return self._clients[0].random(request, context=context, annotated=annotated, lazy=lazy)
        ids = self.free_instance_ids() or self.instance_ids()
        if not ids:
            return self._clients[0].random(request, context=context, annotated=annotated, lazy=lazy)
        return self.direct(request, _random.choice(ids), context=context, annotated=annotated, lazy=lazy)

    generate = random

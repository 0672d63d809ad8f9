"""The KV router as a service of its own (Dynamo 1.x's ``python -m dynamo.router --endpoint ns.comp.ep``).

It follows the workers at ``ns.comp.ep`` as a frontend does (the model watcher, a KV router per model fed
by the workers' KV events) and serves, in component ``router`` of the workers' namespace, as 1.x does:

* ``best_worker_id``: a request's token ids (a list, or ``{"token_ids": [...], "model": ...}``) -> one
  item, the instance id of the worker the router would pick now.  A pure query: nothing is booked.
* ``generate``: a pre-processed request (``{"token_ids": [...], "model": ..., ...}``, our token-level
  protocol) routed to that worker and its items streamed back unchanged; the request counts as in flight
  on the worker from the choice to the end of the stream, in this router's load figures (and, with
  replica sync, in every peer router's).

Why a frontend module: it is the frontend's router without the HTTP side, and it reuses the frontend's
discovery (``ModelWatcher``) and KV policy; only the requests arrive over the request plane.  A frontend
cannot yet hand its routing to this service (see docs/cli-1x.md, "dynamo.router"): clients that want the
router's answer ask ``best_worker_id`` and send to that instance themselves, or send to ``generate``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator

from dynamo.errors import RequestError
from dynamo.frontend.discovery import ModelWatcher
from dynamo.frontend.model_builder import RemoteModel
from dynamo.frontend.model_manager import ModelManager
from dynamo.frontend.remote import RouterConfig
from dynamo.runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

ROUTER_COMPONENT = "router"


class RouterHandler:
    """The two endpoints' handlers over one model watcher, for the workers at ``worker_endpoint``."""

    def __init__(self, watcher: ModelWatcher, worker_endpoint: tuple[str, str, str]) -> None:
        self.watcher = watcher
        self.worker_endpoint = worker_endpoint

    def served(self, model: str | None) -> RemoteModel:
        """The model served at the workers' endpoint (``model`` names it when there are several)."""
        here = [s for s in self.watcher.served.values()
                if self.worker_endpoint in s.endpoints and s.router is not None]
        if model:
            named = [s for s in here if s.name == model]
            if named:
                return named[0]
            if len(here) != 1:
                raise RequestError(f"model {model!r} is not served at {'.'.join(self.worker_endpoint)}")
        if not here:
            raise RequestError(f"no workers at {'.'.join(self.worker_endpoint)} yet")
        if len(here) > 1:
            raise RequestError("several models are served at " + ".".join(self.worker_endpoint)
                               + ": name one with \"model\"")
        return here[0]

    @staticmethod
    def token_ids(request: Any) -> tuple[list[int], str | None]:
        if isinstance(request, list):
            return [int(t) for t in request], None
        if isinstance(request, dict) and isinstance(request.get("token_ids"), list):
            model = request.get("model")
            return [int(t) for t in request["token_ids"]], model if isinstance(model, str) else None
        raise RequestError("expected token ids: a list, or {\"token_ids\": [...]}")

    @staticmethod
    def candidates(served: RemoteModel) -> list[int]:
        ids = served.client.free_instance_ids() or served.client.instance_ids()
        if not ids:
            raise RequestError(f"no live instances serve {served.name}")
        return ids

    async def best_worker_id(self, request: Any) -> AsyncIterator[int]:
        tokens, model = self.token_ids(request)
        served = self.served(model)
        router = served.router.kv_router  # type: ignore[union-attr]
        decision = router.select(tokens, self.candidates(served))
        log.debug("best_worker_id: %d tokens -> worker %x (%d cached blocks)", len(tokens), decision.worker_id,
                  decision.overlap_blocks)
        yield decision.worker_id

    async def generate(self, request: Any, context: Any = None) -> AsyncIterator[Any]:
        tokens, model = self.token_ids(request)
        served = self.served(model)
        policy = served.router
        router = policy.kv_router  # type: ignore[union-attr]
        rid = str(context.id()) if context is not None and hasattr(context, "id") else uuid.uuid4().hex
        decision = router.select(tokens, self.candidates(served), request_id=rid)
        body = dict(request)
        body["estimated_prefix_hit_num_blocks"] = decision.overlap_blocks
        log.debug("generate %s: %d tokens -> worker %x (%d cached blocks)", rid, len(tokens), decision.worker_id,
                  decision.overlap_blocks)
        first = True
        try:
            async for item in served.client.direct(body, decision.worker_id):
                if first:
                    first = False
                    router.on_first_token(rid)
                yield item
        finally:
            router.on_finished(rid)


async def serve_router(runtime: DistributedRuntime, worker_endpoint: tuple[str, str, str], config: RouterConfig,
                       stop: asyncio.Event) -> int:
    """Follow the workers and serve ``best_worker_id`` and ``generate`` until ``stop``."""
    namespace = worker_endpoint[0]
    manager = ModelManager()
    watcher = ModelWatcher(runtime, manager, config, namespace=namespace)
    await watcher.start()
    handler = RouterHandler(watcher, worker_endpoint)
    component = runtime.namespace(namespace).component(ROUTER_COMPONENT)
    await component.create_service()
    tasks = [asyncio.create_task(component.endpoint("generate").serve_endpoint(handler.generate)),
             asyncio.create_task(component.endpoint("best_worker_id").serve_endpoint(handler.best_worker_id))]
    log.info("KV router serving %s.%s.generate and .best_worker_id for the workers at %s", namespace,
             ROUTER_COMPONENT, ".".join(worker_endpoint))
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stopper not in done:
            for t in done:
                t.result()  # why serving ended
        runtime.shutdown()
        await asyncio.gather(*tasks, return_exceptions=True)
        return 0
    finally:
        stopper.cancel()
        await watcher.close()

"""The ``virtual`` connector: decisions go to the discovery store, an outside orchestrator carries them out.

Keys (plain keys, no lease: a decision outlives a planner restart), JSON values, Dynamo's field names::

    planner/<namespace>/decision            {"decision_id": 7, "num_prefill_workers": 1, "num_decode_workers": 3}
    planner/<namespace>/scaled_decision_id  7     (written by the orchestrator once the fleet is that size)

The planner writes decision ``n + 1`` only after ``scaled_decision_id`` reached ``n``: one decision at a
time, so an orchestrator that is slow (pods take minutes) is never handed a queue of stale ones.  A planner
that starts again continues the numbering.  The orchestrator's side is :class:`VirtualConnectorClient`
(``get``, ``wait``, ``complete``: the names of Dynamo's client); ``examples/planner_virtual_orchestrator.py``
drives ``dynamo-run`` worker processes with it.

The fleet the planner sees is the workers registered in discovery (instances of the prefill and decode
components' endpoints in the namespace); workers of a decision not yet carried out count as starting.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from dynamo.planner.connector import FleetState, PoolState
from dynamo.runtime.kv_store import KeyValueStore
from dynamo.runtime.names import INSTANCE_ROOT

log = logging.getLogger(__name__)


def decision_key(namespace: str) -> str:
    return f"planner/{namespace}/decision"


def ack_key(namespace: str) -> str:
    return f"planner/{namespace}/scaled_decision_id"


@dataclass(frozen=True, slots=True)
class PlannerDecision:
    decision_id: int
    num_prefill_workers: int
    num_decode_workers: int

    def json(self) -> dict[str, int]:
        return {"decision_id": self.decision_id, "num_prefill_workers": self.num_prefill_workers,
                "num_decode_workers": self.num_decode_workers}

    @classmethod
    def parse(cls, value: Any) -> "PlannerDecision":
        return cls(int(value["decision_id"]), int(value["num_prefill_workers"]), int(value["num_decode_workers"]))


async def _read_decision(store: KeyValueStore, namespace: str) -> PlannerDecision | None:
    kv = await store.get(decision_key(namespace))
    if kv is None:
        return None
    try:
        return PlannerDecision.parse(kv.json())
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed planner decision under %s", decision_key(namespace))
        return None


async def _read_ack(store: KeyValueStore, namespace: str) -> int:
    kv = await store.get(ack_key(namespace))
    try:
        return int(kv.json()) if kv is not None else 0
    except (ValueError, TypeError):
        return 0


async def registered_workers(store: KeyValueStore, namespace: str, component: str) -> int:
    """Workers of ``namespace.component`` registered in discovery (distinct instances over its endpoints)."""
    keys = await store.get_prefix(f"{INSTANCE_ROOT}/{namespace}/{component}/")
    return len({kv.key.rsplit("/", 1)[-1] for kv in keys})  # v1/instances/ns/comp/ep/{id:x}


class VirtualConnector:
    """The planner's side: write a decision, count the registered workers."""

    def __init__(self, store: KeyValueStore, namespace: str, prefill_component: str | None,
                 decode_component: str) -> None:
        self.store = store
        self.namespace = namespace
        self.components = {"prefill": prefill_component, "decode": decode_component}
        self.last: PlannerDecision | None = None
        self.waiting_logged = False

    async def start(self) -> FleetState:
        self.last = await _read_decision(self.store, self.namespace)
        if self.last is not None:
            log.info("continuing after planner decision %d", self.last.decision_id)
        return await self.fleet()

    async def _registered(self, component: str | None) -> int:
        if component is None:  # an aggregated fleet has no prefill pool
            return 0
        return await registered_workers(self.store, self.namespace, component)

    async def fleet(self) -> FleetState:
        ready_prefill = await self._registered(self.components["prefill"])
        ready_decode = await self._registered(self.components["decode"])
        want_prefill = self.last.num_prefill_workers if self.last else ready_prefill
        want_decode = self.last.num_decode_workers if self.last else ready_decode
        return FleetState(prefill=PoolState(ready=ready_prefill, starting=max(0, want_prefill - ready_prefill)),
                          decode=PoolState(ready=ready_decode, starting=max(0, want_decode - ready_decode)))

    async def scale(self, prefill: int, decode: int) -> bool:
        last = self.last
        if last is not None:
            if (last.num_prefill_workers, last.num_decode_workers) == (prefill, decode):
                return True
            acked = await _read_ack(self.store, self.namespace)
            if acked < last.decision_id:
                if not self.waiting_logged:
                    log.info("decision %d not acknowledged by the orchestrator yet; holding the next one",
                             last.decision_id)
                    self.waiting_logged = True
                return False
        decision = PlannerDecision((last.decision_id if last else 0) + 1, prefill, decode)
        await self.store.put(decision_key(self.namespace), decision.json())
        self.last = decision
        self.waiting_logged = False
        return True

    async def close(self) -> None:
        return None


class VirtualConnectorClient:
    """The orchestrator's side: read the planner's decisions and acknowledge them.

    ``await client.wait()`` returns once there is a decision newer than the last one completed;
    ``await client.get()`` reads the current one; ``await client.complete(decision)`` says the fleet now
    has that many workers, which lets the planner make its next decision.
    """

    def __init__(self, runtime: Any, namespace: str) -> None:
        self.store: KeyValueStore = runtime.discovery()
        self.namespace = namespace

    async def get(self) -> PlannerDecision | None:
        return await _read_decision(self.store, self.namespace)

    async def wait(self, timeout: float | None = None) -> PlannerDecision:
        """The next decision not yet completed (at once if there is one)."""
        return await asyncio.wait_for(self._wait(), timeout)

    async def _wait(self) -> PlannerDecision:
        watch = await self.store.watch_prefix(f"planner/{self.namespace}/").start()
        try:
            current = await self.get()
            if current is not None and current.decision_id > await _read_ack(self.store, self.namespace):
                return current
            async for ev in watch:
                if ev.kind != "put" or ev.key != decision_key(self.namespace):
                    continue
                try:
                    decision = PlannerDecision.parse(orjson.loads(ev.value))
                except (ValueError, KeyError, TypeError):
                    continue
                if decision.decision_id > await _read_ack(self.store, self.namespace):
                    return decision
            raise ConnectionError("the discovery watch ended")
        finally:
            await watch.close()

    async def complete(self, decision: PlannerDecision) -> None:
        await self.store.put(ack_key(self.namespace), decision.decision_id)

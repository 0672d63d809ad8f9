"""The virtual connector's round trip on real etcd: the planner writes a decision, the orchestrator's
client waits for it and acknowledges it, and only then does the planner write the next one."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.planner.virtual_connector import VirtualConnector, VirtualConnectorClient
from dynamo.runtime.distributed import DistributedRuntime

pytestmark = pytest.mark.timeout(60)


async def test_decision_ack_round_trip(runtime_env):
    runtime = await DistributedRuntime.connect()
    try:
        planner = VirtualConnector(runtime.discovery(), "vns", "prefill", "backend")
        client = VirtualConnectorClient(runtime, "vns")
        fleet = await planner.start()
        assert (fleet.prefill.coming, fleet.decode.coming) == (0, 0)
        waiting = asyncio.create_task(client.wait(timeout=10))
        assert await planner.scale(1, 2)
        first = await waiting
        assert (first.decision_id, first.num_prefill_workers, first.num_decode_workers) == (1, 1, 2)
        assert (await planner.fleet()).decode.starting == 2  # asked for, not registered yet
        # not acknowledged: the next decision is held
        assert not await planner.scale(1, 3)
        assert (await client.get()).decision_id == 1
        await client.complete(first)
        assert await planner.scale(1, 3)
        second = await client.wait(timeout=10)
        assert (second.decision_id, second.num_decode_workers) == (2, 3)
        # a planner that starts again continues the numbering
        again = VirtualConnector(runtime.discovery(), "vns", "prefill", "backend")
        await again.start()
        await client.complete(second)
        assert await again.scale(2, 3)
        assert (await client.get()).decision_id == 3
    finally:
        await runtime.close()

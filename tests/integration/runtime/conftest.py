"""Fixtures for runtime integration tests: runtimes connected to the real etcd + nats-server (the
session-scoped ``runtime_servers`` of harness/server_fixtures.py, a plugin tests/conftest.py loads), and a
unique namespace per test."""

from __future__ import annotations

import asyncio
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest

_ROOT = Path(__file__).resolve().parents[3]
for _p in (str(_ROOT), str(_ROOT / "src")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from dynamo.runtime import DistributedRuntime, Endpoint, WorkerBusyError  # noqa: E402
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings  # noqa: E402
from harness.servers import RuntimeServers  # noqa: E402


def settings_for(servers: RuntimeServers, **overrides) -> RuntimeSettings:
    settings = RuntimeSettings(etcd=EtcdSettings([servers.etcd.url]), nats=NatsSettings(servers.nats.url))
    for key, value in overrides.items():
        setattr(settings, key, value)
    return settings


@pytest.fixture
def ns() -> str:
    """A namespace no other test uses, so tests can share the session's servers."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def make_runtime(runtime_servers: RuntimeServers) -> AsyncIterator[Callable[..., Awaitable[DistributedRuntime]]]:
    """``rt = await make_runtime(**settings_overrides)``; every runtime is closed after the test."""
    made: list[DistributedRuntime] = []

    async def make(static: bool = False, **overrides) -> DistributedRuntime:
        rt = await DistributedRuntime.connect(settings_for(runtime_servers, **overrides), static=static)
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        await rt.close()


async def start_serving(endpoint: Endpoint, handler, **kwargs) -> asyncio.Task:
    """Run serve_endpoint in a task and return once the instance is registered."""
    ready = asyncio.Event()
    task = asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready, **kwargs))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises the serving error
    if waiter not in done:
        waiter.cancel()
        raise TimeoutError("endpoint did not become ready")
    return task


@pytest.fixture
def serve() -> Callable[..., Awaitable[asyncio.Task]]:
    """``task = await serve(endpoint, handler)``: serve_endpoint in a task, returning once registered."""
    return start_serving


@dataclass
class AtItsLimit:
    """A worker serving ``endpoint`` with one request at a time, holding ``first`` (a caller's request) until
    :meth:`finish`; a second request was refused as busy, and the caller's ``client`` still lists it."""

    endpoint: Endpoint
    client: Any
    first: Any
    release: asyncio.Event

    async def finish(self) -> list:
        """Let the held request end; what it yielded after its first item."""
        self.release.set()
        return [x async for x in self.first]


async def worker_at_its_limit(worker: DistributedRuntime, caller: DistributedRuntime, ns: str) -> AtItsLimit:
    release = asyncio.Event()

    async def held(request):
        yield {"started": True}
        await release.wait()
        yield {"done": True}

    endpoint = worker.namespace(ns).component("b").endpoint("g")
    await start_serving(endpoint, held, max_inflight=1)
    client = await caller.namespace(ns).component("b").endpoint("g").client()
    await client.wait_for_instances(5)
    first = client.round_robin({})
    assert await first.__anext__() == {"started": True}
    with pytest.raises(WorkerBusyError):
        await client.direct({}, worker.instance_id).start()
    assert client.instance_ids() == [worker.instance_id]  # busy is not down
    return AtItsLimit(endpoint, client, first, release)


@pytest.fixture
def at_its_limit() -> Callable[[DistributedRuntime, DistributedRuntime, str], Awaitable[AtItsLimit]]:
    """``busy = await at_its_limit(worker_runtime, caller_runtime, ns)``: see :class:`AtItsLimit`."""
    return worker_at_its_limit

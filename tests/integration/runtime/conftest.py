"""Fixtures for runtime integration tests: real etcd + nats-server (session-scoped, from
harness/servers.py), runtimes connected to them, and a unique namespace per test."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest

_ROOT = Path(__file__).resolve().parents[3]
for _p in (str(_ROOT), str(_ROOT / "src")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from dynamo.runtime import DistributedRuntime, Endpoint  # noqa: E402
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings  # noqa: E402
from harness.servers import (  # noqa: E402,F401  (fixtures re-exported for pytest)
    RuntimeServers,
    etcd_server,
    nats_server,
    runtime_env,
    runtime_servers,
)


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

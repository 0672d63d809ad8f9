"""Fixtures for runtime integration tests: runtimes connected to the real etcd + nats-server (the
session-scoped ``runtime_servers`` of harness/server_fixtures.py, a plugin tests/conftest.py loads), a
unique namespace per test, and real worker processes (``spawn``: worker_app.py, as users write one)."""

from __future__ import annotations

import asyncio
import os
import subprocess
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

WORKER_APP = Path(__file__).with_name("worker_app.py")


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


@pytest.fixture
async def file_runtimes(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[DistributedRuntime]]]:
    """``rt = await file_runtimes(**settings_overrides)``: runtimes of one fleet on a file store of their own
    (TCP requests, ZMQ events; no etcd, no NATS), the rest of their settings read from the environment as a
    process reads them at start-up; every one closed after the test."""
    made: list[DistributedRuntime] = []

    async def make(**overrides: Any) -> DistributedRuntime:
        settings = RuntimeSettings.from_env()
        settings.discovery_backend, settings.file_kv = "file", str(tmp_path / "kv")
        settings.request_plane, settings.event_plane = "tcp", "zmq"
        for key, value in overrides.items():
            setattr(settings, key, value)
        rt = await DistributedRuntime.connect(settings)
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


class WorkerProcess:
    """worker_app.py serving ``namespace``; it prints ``READY <instance id in hex>`` once registered."""

    def __init__(self, env: dict[str, str], namespace: str, extra_env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_APP), namespace],
            env={**os.environ, **env, **(extra_env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.instance_hex = ""
        self.system_port: int | None = None  # its status server's port, when it runs one

    async def ready(self, timeout: float = 20) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"worker failed: {line!r} {self.proc.stderr.read()}")
        self.instance_hex = line.split()[1]
        for word in line.split()[2:]:
            if word.startswith("system="):
                self.system_port = int(word[len("system="):])
        return self.instance_hex

    @property
    def instance_id(self) -> int:
        return int(self.instance_hex, 16)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def spawn(runtime_servers: RuntimeServers):
    """``worker = spawn(namespace, **extra_env)``: worker_app.py in a subprocess on the session's servers
    (``await worker.ready()`` for its instance); every one is killed after the test."""
    started: list[WorkerProcess] = []

    def make(namespace: str, **extra_env: str) -> WorkerProcess:
        w = WorkerProcess(runtime_servers.env, namespace, extra_env)
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop()

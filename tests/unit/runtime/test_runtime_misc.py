"""Context signalling, handler detection, settings from the environment."""

import asyncio

from dynamo.runtime.config import RuntimeSettings
from dynamo.runtime.context import Context
from dynamo.runtime.etcd import prefix_range_end
from dynamo.runtime.ingress import handler_takes_context


async def test_context_signals():
    ctx = Context("rid")
    seen = []
    ctx.add_callback(seen.append)
    waiter = asyncio.create_task(ctx.stopped())
    await asyncio.sleep(0)
    assert not ctx.is_stopped()
    ctx.stop_generating()
    await asyncio.wait_for(waiter, 1)
    assert ctx.is_stopped() and not ctx.is_killed()
    ctx.kill()
    ctx.kill()
    assert ctx.is_killed() and seen == ["stop", "kill"] and ctx.id() == "rid"


def test_handler_takes_context():
    async def one(request):
        yield request

    async def two(request, context):
        yield request

    class H:
        async def generate(self, request):
            yield request

        async def generate_ctx(self, request, context=None):
            yield request

    assert not handler_takes_context(one)
    assert handler_takes_context(two)
    assert not handler_takes_context(H().generate)
    assert handler_takes_context(H().generate_ctx)


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://a:1, b:2")
    monkeypatch.setenv("NATS_SERVER", "nats://n:4")
    monkeypatch.setenv("NATS_AUTH_TOKEN", "tok")
    monkeypatch.setenv("DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT", "3")
    s = RuntimeSettings.from_env()
    assert s.etcd.endpoints == ["http://a:1", "http://b:2"]
    assert s.nats.server == "nats://n:4" and s.nats.token == "tok"
    assert s.graceful_shutdown_timeout == 3.0 and s.lease_ttl == 10


def test_settings_defaults(monkeypatch):
    for var in ("ETCD_ENDPOINTS", "NATS_SERVER", "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    s = RuntimeSettings.from_env()
    assert s.etcd.endpoints == ["http://localhost:2379"]
    assert s.nats.server == "nats://localhost:4222"
    assert s.graceful_shutdown_timeout == 30.0


def test_prefix_range_end():
    assert prefix_range_end(b"abc") == b"abd"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff") == b"\0"

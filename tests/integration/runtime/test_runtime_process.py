"""A real worker subprocess: discovery across processes, kill -9 mid-stream, lease expiry, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo.runtime import STREAM_INCOMPLETE_MESSAGE, StreamIncompleteError

WORKER_APP = Path(__file__).with_name("worker_app.py")


async def test_separate_worker_process(make_runtime, ns, spawn):
    worker = spawn(ns)
    await worker.ready()
    caller = await make_runtime()
    client = await caller.namespace(ns).component("backend").endpoint("generate").client()
    assert await client.wait_for_instances(10) == [worker.instance_id]
    items = [item async for item in client.round_robin({"n": 5})]
    assert [x["i"] for x in items] == [0, 1, 2, 3, 4]
    assert items[0]["pid"] == worker.proc.pid


@pytest.mark.parametrize("transport, limit", [("tcp", 2.0), pytest.param("nats", 9.0, marks=pytest.mark.slow)])
async def test_kill_9_mid_stream_gives_incomplete_error(make_runtime, ns, spawn, transport, limit):
    """TCP: the socket closes, so at once. NATS: the liveness window (6 s) runs out."""
    worker = spawn(ns)
    await worker.ready()
    caller = await make_runtime(response_transport=transport)
    client = await caller.namespace(ns).component("backend").endpoint("generate").client()
    await client.wait_for_instances(10)
    got = []
    with pytest.raises(StreamIncompleteError) as err:
        async for item in client.generate({"n": 1000, "delay": 0.02}):
            got.append(item)
            if len(got) == 3:
                os.kill(worker.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert str(err.value) == STREAM_INCOMPLETE_MESSAGE == "Stream ended before generation completed"
    assert time.monotonic() - killed_at < limit
    assert 3 <= len(got) < 1000
    assert client.instance_ids() == []  # reported down


@pytest.mark.slow
async def test_instance_key_vanishes_after_lease_expiry(make_runtime, ns, spawn):
    worker = spawn(ns)
    hex_id = await worker.ready()
    caller = await make_runtime()
    key = f"v1/instances/{ns}/backend/generate/{hex_id}"
    assert await caller.etcd.get(key) is not None
    os.kill(worker.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while await caller.etcd.get(key) is not None:
        assert time.monotonic() - killed_at < 16, "instance key outlived the 10 s lease"
        await asyncio.sleep(0.25)
    assert time.monotonic() - killed_at > 3  # it was the lease, not a graceful delete


async def test_sigterm_is_graceful(make_runtime, ns, spawn):
    worker = spawn(ns)
    hex_id = await worker.ready()
    caller = await make_runtime()
    client = await caller.namespace(ns).component("backend").endpoint("generate").client()
    await client.wait_for_instances(10)
    stream = client.generate({"n": 20, "delay": 0.05})
    first = await stream.__anext__()
    worker.proc.send_signal(signal.SIGTERM)
    rest = [item async for item in stream]  # the in-flight request completes
    assert [x["i"] for x in [first] + rest] == list(range(20))
    assert await caller.etcd.get(f"v1/instances/{ns}/backend/generate/{hex_id}") is None
    out = await asyncio.to_thread(worker.proc.stdout.read)
    assert "EXITED" in out
    assert await asyncio.to_thread(worker.proc.wait, 10) == 0


async def test_worker_with_unreachable_nats_exits_with_one_line(ns, runtime_servers):
    # asked for the NATS request plane (without it, no NATS means the TCP and ZMQ planes instead)
    env = {**os.environ, **runtime_servers.env, "NATS_SERVER": "nats://127.0.0.1:1", "DYN_REQUEST_PLANE": "nats"}
    start = time.monotonic()
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(WORKER_APP), ns], env=env, capture_output=True, text=True, timeout=30
    )
    assert time.monotonic() - start < 10
    assert proc.returncode != 0
    assert "cannot reach NATS at nats://127.0.0.1:1: connection refused" in proc.stderr

"""The worker's status server (DYN_SYSTEM_*): /health readiness, /live, dynamo_component_* counts.

A real worker process (worker_app.py, written as users write one) over the session's etcd and NATS,
scraped over HTTP as Prometheus and Kubernetes probes would.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.runtime import EngineError
from dynamo.runtime.config import RuntimeConfigError, SystemSettings


async def start_serving(endpoint, handler) -> asyncio.Task:
    """serve_endpoint in a task; returns once the endpoint is registered and taking requests."""
    ready = asyncio.Event()
    task = asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    return task


def samples(text: str, endpoint: str = "generate") -> dict[tuple[str, str], float]:
    """(sample name, error_type or "") -> value, for one endpoint's dynamo_component_* series."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("dynamo_endpoint") == endpoint and "le" not in s.labels:
                out[(s.name, s.labels.get("error_type", ""))] = s.value
    return out


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


async def test_worker_process_health_and_component_metrics(make_runtime, ns, spawn):
    worker = spawn(ns, DYN_SYSTEM_ENABLED="true", DYN_SYSTEM_PORT="0", DYN_SYSTEM_HOST="127.0.0.1",
                   DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT="10")
    await worker.ready()
    port = worker.system_port
    assert port
    base = f"http://127.0.0.1:{port}"
    health = await get(base + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ready" and health.json()["endpoints"] == {"generate": "ready"}
    assert (await get(base + "/live")).json()["status"] == "live"

    caller = await make_runtime()
    client = await caller.namespace(ns).component("backend").endpoint("generate").client()
    await client.wait_for_instances(10)
    for n in (1, 2, 3):
        assert len([x async for x in client.round_robin({"n": n})]) == n
    with pytest.raises(EngineError):  # the handler calls .get on a list: it raises mid-stream
        _ = [x async for x in client.round_robin([1])]

    m = samples((await get(base + "/metrics")).text)
    assert m[("dynamo_component_requests_total", "")] == 4
    assert m[("dynamo_component_request_duration_seconds_count", "")] == 4
    assert m[("dynamo_component_inflight_requests", "")] == 0
    assert m[("dynamo_component_errors_total", "generate")] == 1
    assert m[("dynamo_component_errors_total", "deserialization")] == 0
    assert m[("dynamo_component_request_bytes_total", "")] > 0
    # 6 items of {"i", "pid"} plus one error item at least
    assert m[("dynamo_component_response_bytes_total", "")] >= 6 * len('{"i":0,"pid":1}')

    # a stream in flight, then SIGTERM: /health turns 503 while the endpoint drains, the stream completes
    stream = client.round_robin({"n": 20, "delay": 0.05})
    items = [await stream.__anext__()]
    assert samples((await get(base + "/metrics")).text)[("dynamo_component_inflight_requests", "")] == 1
    worker.proc.send_signal(signal.SIGTERM)
    for _ in range(100):
        health = await get(base + "/health")
        if health.status_code == 503:
            break
        await asyncio.sleep(0.02)
    assert health.status_code == 503 and health.json()["status"] == "notready"
    items += [x async for x in stream]
    assert len(items) == 20


async def test_health_follows_endpoints_and_port_zero_is_logged(make_runtime, ns, caplog):
    caplog.set_level("INFO", logger="dynamo.runtime.system_server")
    settings = SystemSettings(enabled=True, host="127.0.0.1", port=0, required_endpoints=["generate"])
    rt = await make_runtime(system=settings)
    assert rt.system is not None and rt.system.port
    assert f"127.0.0.1:{rt.system.port}" in caplog.text
    base = f"http://127.0.0.1:{rt.system.port}"
    before = await get(base + "/health")
    assert before.status_code == 503 and before.json() == {**before.json(), "status": "notready", "endpoints": {}}

    async def gen(request):
        yield request

    component = rt.namespace(ns).component("backend")
    # an endpoint that is not required is ready: still 503 until "generate" serves
    await start_serving(component.endpoint("load_metrics"), gen)
    assert (await get(base + "/health")).status_code == 503
    await start_serving(component.endpoint("generate"), gen)
    after = await get(base + "/health")
    assert after.status_code == 200
    assert after.json()["endpoints"] == {"load_metrics": "ready", "generate": "ready"}


async def test_system_server_off_by_default(make_runtime):
    rt = await make_runtime()
    assert rt.system is None


@pytest.mark.parametrize("env, expected", [
    ({}, (False, 8081)),
    ({"DYN_SYSTEM_ENABLED": "true"}, (True, 8081)),
    ({"DYN_SYSTEM_PORT": "9090"}, (True, 9090)),  # Dynamo 1.x: a port alone turns it on
    ({"DYN_SYSTEM_PORT": "-1"}, (False, 0)),
    ({"DYN_SYSTEM_ENABLED": "false", "DYN_SYSTEM_PORT": "9090"}, (False, 9090)),
    ({"DYN_SYSTEM_ENABLED": "1", "DYN_SYSTEM_PORT": "0"}, (True, 0)),
])
def test_system_settings_from_env(monkeypatch, env, expected):
    for key in ("DYN_SYSTEM_ENABLED", "DYN_SYSTEM_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = SystemSettings.from_env()
    assert (s.enabled, s.port) == expected


@pytest.mark.parametrize("env, message", [
    ({"DYN_SYSTEM_ENABLED": "maybe"}, "DYN_SYSTEM_ENABLED='maybe'"),
    ({"DYN_SYSTEM_PORT": "http"}, "not a port number"),
    ({"DYN_SYSTEM_PORT": "70000"}, "must be -1"),
    ({"DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": "-1"}, "choose a port"),
    ({"DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": "generate"}, "JSON list"),
    ({"DYN_SYSTEM_HEALTH_PATH": "health"}, "must start with /"),
])
def test_bad_system_settings_are_clear_errors(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeConfigError, match=message):
        SystemSettings.from_env()

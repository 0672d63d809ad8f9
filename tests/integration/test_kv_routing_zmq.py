"""KV-aware routing on the TCP request plane and the ZMQ event plane: mocker workers and frontends started
with ``--request-plane tcp --event-plane zmq``, found through a real etcd, and no NATS server at all
(``NATS_SERVER`` names a closed port): the model cards' tokenizers go in etcd's object store.

The test watches the router's decisions (topic ``kv-hit-rate``) and the workers' KV events (``kv-events``)
the way the frontend does: a runtime of its own on the ZMQ event plane, following the publishers that
``v1/event_channels`` names.
"""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import httpx
import pytest

from dynamo.runtime import DistributedRuntime
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.v1_event_wire import EndpointScope
from harness.events import channels, follow
from harness.fleet import kv_frontend, sees_instances, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, free_port
from harness.wait import until, wait_until

pytestmark = pytest.mark.timeout(120)

NS = "kvz"
BLOCK_SIZE = 16
MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": BLOCK_SIZE, "speedup_ratio": 20.0}
PLANES = ("--request-plane", "tcp", "--event-plane", "zmq")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": f"nats://127.0.0.1:{free_port()}",
               "DYN_LOG": "info,dynamo.worker.handlers=debug"}


@pytest.fixture(scope="module")
def args_file(tmp_path_factory) -> Path:
    return write_engine_args(tmp_path_factory.mktemp("mocker") / "mocker.json", MOCKER_ARGS)


def mocker(servers: dict[str, str], tiny_model: Path, args_file: Path, **env: str) -> DynamoWorker:
    return DynamoWorker(f"in=dyn://{NS}.mocker.generate", "out=mocker", str(tiny_model), "--model-name", NS,
                        "--extra-engine-args", str(args_file), *PLANES, env={**servers, **env})


@pytest.fixture(scope="module")
def workers(servers, tiny_model, args_file) -> Iterator[list[DynamoWorker]]:
    with workers_running([mocker(servers, tiny_model, args_file) for _ in range(2)]) as fleet:
        yield fleet


def start_frontend(servers: dict[str, str], workers: list[DynamoWorker]) -> DynamoRun:
    return kv_frontend(servers, *PLANES, ready=sees_instances([w for w in workers if w.running]),
                       what="the frontend to see the workers")


@pytest.fixture(scope="module")
def frontend(servers, workers) -> Iterator[DynamoRun]:
    with start_frontend(servers, workers) as fe:
        yield fe


_rng = random.Random(7)


def text(words: int) -> str:
    return " ".join("".join(_rng.choice("abcdefghij") for _ in range(5)) for _ in range(words))


async def observer(servers: dict[str, str]) -> DistributedRuntime:
    """A runtime on the frontend's planes, with no NATS at all."""
    return await DistributedRuntime.connect(RuntimeSettings(
        etcd=EtcdSettings([servers["ETCD_ENDPOINTS"]]), nats=NatsSettings(f"nats://127.0.0.1:{free_port()}"),
        request_plane="tcp", event_plane="zmq"))


async def watched(servers: dict[str, str], body: Callable[[DistributedRuntime, list, dict], Awaitable[Any]],
                  all_publishers: bool = True) -> Any:
    """Run ``body(rt, decisions, stored)`` while following the router's decisions and the blocks each
    worker announced as stored (both over ZMQ); ``all_publishers``: once connected to every publisher
    in discovery (none of them may be dead)."""
    rt = await observer(servers)
    decisions: list[dict[str, Any]] = []
    stored: dict[int, int] = {}

    def on_kv(e: dict[str, Any]) -> None:
        data = e["event"]["data"]
        if isinstance(data, dict) and "stored" in data:
            stored[e["worker_id"]] = stored.get(e["worker_id"], 0) + len(data["stored"]["blocks"])

    try:
        scope = EndpointScope(NS, "mocker", "generate")
        await follow(rt, scope, "kv-hit-rate", decisions.append)
        await follow(rt, scope, "kv-events", on_kv)
        # connected to every publisher (the workers' and the frontends'), handshakes done
        if all_publishers:
            publishers = await channels(rt, scope, "kv-hit-rate", "kv-events")
            await until(lambda: rt.event_plane().reconnects >= publishers, 10, "connections to the publishers")
        return await body(rt, decisions, stored)
    finally:
        await rt.close()


async def complete(fe: DynamoRun, prompt: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(fe.api_url + "/completions", json={"model": NS, "prompt": prompt, "max_tokens": 3})
    assert resp.status_code == 200, resp.text


def test_kv_events_over_zmq_send_a_shared_prefix_to_the_worker_that_caches_it(servers, workers, frontend):
    prefix = text(120)

    async def body(rt, decisions, stored) -> None:
        await complete(frontend, prefix + " " + text(10))
        await until(lambda: decisions, 10, "the router's decision")
        first = decisions[0]
        assert first["overlap_blocks"] == 0 and first["isl_blocks"] > 20
        want = first["isl_blocks"]
        await until(lambda: stored.get(first["worker_id"], 0) >= want, 10, "the worker's stored-blocks events")
        # the frontend is subscribed to the same publisher as this observer; its copy of the events may
        # trail ours by a moment, so the next prompts go until one finds the prefix cached
        for _ in range(5):
            await complete(frontend, prefix + " " + text(10))
            await until(lambda: len(decisions) >= 2, 10, "the next decision")
            if decisions[-1]["overlap_blocks"] > 0:
                break
        hit = decisions[-1]
        assert hit["worker_id"] == first["worker_id"]
        assert hit["overlap_blocks"] >= first["isl_blocks"] - 4, (first, hit)
        return None

    asyncio.run(watched(servers, body))


def test_a_frontend_started_later_catches_up_from_kv_state_over_tcp(servers, workers):
    """A frontend that starts after the workers cached a prompt asks each worker's recovery endpoint for
    what it holds (over the TCP request plane) and routes the prompt to the worker that holds it at once."""
    prefix = text(120)
    early = start_frontend(servers, workers)
    try:
        async def cache(rt, decisions, stored) -> dict[str, Any]:
            await complete(early, prefix + " " + text(10))
            await until(lambda: decisions, 10, "the router's decision")
            first = decisions[0]
            await until(lambda: stored.get(first["worker_id"], 0) >= first["isl_blocks"], 10, "stored events")
            return first

        first = asyncio.run(watched(servers, cache))
    finally:
        early.stop()
    late = start_frontend(servers, workers)
    try:
        holder = f"{first['worker_id'] & 0xFFFFFFFFFFFFFFFF:x}"
        pattern = re.compile(rf"KV state of worker {holder}: (\d+) cached blocks")
        wait_until(lambda: pattern.search(late.stderr_text()), 15, "the late frontend to read the worker's KV state")
        assert int(pattern.search(late.stderr_text()).group(1)) >= first["isl_blocks"]

        async def again(rt, decisions, stored) -> dict[str, Any]:
            await complete(late, prefix + " " + text(10))
            await until(lambda: decisions, 10, "the late frontend's decision")
            return decisions[0]

        hit = asyncio.run(watched(servers, again))
        assert hit["worker_id"] == first["worker_id"] and hit["overlap_blocks"] >= first["isl_blocks"] - 4
    finally:
        late.stop()


def test_a_worker_restarted_on_a_new_port_is_reached_there(servers, workers, tiny_model, args_file):
    """kill -9, then a worker on another port (DYN_TCP_RPC_PORT): its instance record has the new address,
    and a (round-robin) frontend that knew the old one sends it requests there, never an error."""
    frontend = DynamoRun("out=dyn", *PLANES, env=servers).start()
    victim = workers[1]
    port = free_port()
    fresh = None
    try:
        want = {w.instance_id for w in workers}
        wait_until(lambda: want <= {i["instance_id"] for i in httpx.get(frontend.base_url + "/health").json().get(
            "instances", [])}, 30, "the frontend to see both workers")
        victim.kill()
        fresh = mocker(servers, tiny_model, args_file, DYN_TCP_RPC_PORT=str(port), DYN_TCP_RPC_HOST="127.0.0.1").start()

        async def address(rt, decisions, stored) -> str:
            kv = await rt.discovery().get(EndpointId(NS, "mocker", "generate").instance_key(fresh.instance_id))
            return Instance.from_json(kv.value).subject

        assert asyncio.run(watched(servers, address, all_publishers=False)).startswith(f"127.0.0.1:{port}/")

        def fresh_serves() -> bool:
            rid = f"fresh-{uuid.uuid4().hex[:12]}"
            resp = httpx.post(frontend.api_url + "/completions", json={"model": NS, "prompt": text(20), "max_tokens": 2},
                              headers={"x-request-id": rid}, timeout=30)
            assert resp.status_code == 200, resp.text  # never an error, whichever worker it reaches
            return f"request {rid}" in fresh.stderr_text()

        wait_until(fresh_serves, 20, "a request to reach the restarted worker", interval=0.1)
    finally:
        if fresh is not None:
            fresh.kill()
        frontend.stop()

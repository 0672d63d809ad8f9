"""KV events between runtimes of ours, on a real etcd, in the one form they have, Dynamo 1.x's: a worker's
publishers (channel records, 4-frame ZMQ messages or NATS envelopes, the EventSource record and the
recovery endpoint) and a KV router that follows a worker of ours as it follows a 1.6.1 worker
(tests/dynamo1x runs the same against 1.6.1's own processes)."""

from __future__ import annotations

import orjson
import pytest

from dynamo.frontend.kv_policy import KvRouterPolicy
from dynamo.kv import KvRouter
from dynamo.kv.events import stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.publisher import emit
from dynamo.kv.v1_events import (
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    decode_router_events,
    dump_from_tree,
    query_source_endpoint,
    recovery_query,
)
from dynamo.kv.worker_state import WorkerKvState
from dynamo.llm.model_entry import V1_CARD, ModelEntry
from dynamo.llm.model_type import ModelType
from dynamo.runtime.codec import encode_frame
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId
from dynamo.runtime.transport import StreamState
from dynamo.runtime.v1_event_wire import EVENT_CHANNELS, EVENT_SOURCES, EndpointScope
from dynamo.worker.kv_publishing import KvPublishing
from harness.wait import until

BLOCK = 16
PLANES = {"zmq": {"event_plane": "zmq", "request_plane": "tcp"}, "nats": {"event_plane": "nats", "request_plane": "tcp"}}


class DumpingEngine:
    """What the recovery endpoint reads: a WorkerKvState's dump (the mocker's and llama.cpp's source)."""

    def __init__(self, state: WorkerKvState) -> None:
        self.state = state

    def kv_state_dump(self) -> dict:
        return self.state.dump()


async def start_worker(rt, ns: str) -> tuple[KvPublishing, WorkerKvState]:
    endpoint = rt.namespace(ns).component("backend").endpoint("generate")
    v1 = await KvPublishing.start(endpoint)
    assert v1 is not None
    publish_kv_event, publish_metrics = v1.callbacks()
    state = WorkerKvState(rt.instance_id, publish_kv_event, first_event_id=5000)
    await v1.serve_recovery(DumpingEngine(state))
    state.metrics = publish_metrics  # type: ignore[attr-defined]
    return v1, state


def store(state: WorkerKvState, tokens: list[int]) -> None:
    local, seq = compute_hashes(tokens, BLOCK)
    state.send(stored_data(None, zip(seq, local, strict=True)))


@pytest.mark.parametrize("planes", ["zmq", "nats"])
async def test_a_subscriber_reads_a_workers_events_and_load(make_runtime, ns, planes):
    worker = await make_runtime(**PLANES[planes])
    frontend = await make_runtime(**PLANES[planes])
    v1, state = await start_worker(worker, ns)
    scope = EndpointScope(ns, "backend", "generate")
    records = {kv.key: orjson.loads(kv.value) for kv in await worker.discovery().get_prefix("v1/event_")}
    channel_key = scope.key(EVENT_CHANNELS, TOPIC_KV_EVENTS, v1.kv_pub.publisher_id)
    assert records[channel_key]["transport"]["kind"] == ("Zmq" if planes == "zmq" else "Nats")
    assert scope.key(EVENT_CHANNELS, TOPIC_KV_METRICS, v1.metrics_pub.publisher_id) in records
    source = records[scope.key(EVENT_SOURCES, TOPIC_KV_EVENTS, v1.kv_pub.publisher_id)]["metadata"]
    assert source["worker"] == {"worker_id": worker.instance_id, "dp_rank": 0}
    assert source["recovery_target"]["endpoint"] == query_source_endpoint(v1.kv_pub.publisher_id)

    router = KvRouter(block_size=BLOCK)
    loads: list[bytes] = []
    plane = frontend.event_plane()
    await plane.subscribe(scope, TOPIC_KV_EVENTS,
                          lambda env: [router.apply_event(e) for e in decode_router_events(env.payload)])
    await plane.subscribe(scope, TOPIC_KV_METRICS, lambda env: loads.append(env.payload))
    prompt = list(range(4 * BLOCK))

    async def arrived() -> bool:  # events before the subscriber's handshake are lost, as the plane allows
        store(state, prompt)
        emit(state.metrics, {"worker_id": worker.instance_id, "data": {"kv_stats": {"kv_active_blocks": 4}}})
        return router.find_matches(prompt) == {worker.instance_id: 4} and loads

    await until(arrived, 10, "the worker's KV events and load")


CARDS = {"ours": {"publishes_kv_events": True},
         "1.x's": {"kv_event_publishing_enabled": True, "enable_local_indexer": True}}


@pytest.mark.parametrize("card", list(CARDS))
@pytest.mark.parametrize("planes", ["zmq", "nats"])
async def test_our_kv_router_recovers_then_follows_a_worker(make_runtime, ns, planes, card):
    """A worker whose entry says it publishes KV events (ours, or a 1.x worker's card) is recovered through
    its recovery endpoint, then followed on the event plane: the same path for both."""
    worker = await make_runtime(**PLANES[planes])
    frontend = await make_runtime(**PLANES[planes])
    v1, state = await start_worker(worker, ns)
    early = list(range(1000, 1000 + 3 * BLOCK))
    store(state, early)  # before the router: only the recovery can tell it
    router = KvRouter(block_size=BLOCK)
    policy = KvRouterPolicy(router, frontend.event_plane(), runtime=frontend)
    entry = ModelEntry("m", ns, "backend", "generate", ModelType.Backend, worker.instance_id,
                       {V1_CARD: {}} if card == "1.x's" else {}, runtime_config=CARDS[card])
    try:
        policy.add_worker(entry)
        await until(lambda: router.find_matches(early) == {worker.instance_id: 3}, 10, "the recovered blocks")
        later = list(range(2000, 2000 + 2 * BLOCK))

        async def live() -> bool:
            store(state, later)
            return router.find_matches(later) == {worker.instance_id: 2}

        await until(live, 10, "live events")
        policy.remove_worker(worker.instance_id)
        store(state, list(range(3000, 3000 + BLOCK)))
        assert router.find_matches(early) == {}
    finally:
        await policy.close()


async def test_the_recovery_endpoint_answers_a_1x_client_with_a_bare_tree_dump(make_runtime, ns):
    """To a request without our client's mark (as a 1.6.1 router asks) the answer goes without an Annotated layer
    (runtime.annotated.BareItem: the bytes are pinned against 1.6.1's in test_v1_event_wire.py), and our
    client reads such an answer (a 1.x control endpoint's) as the item itself."""
    worker = await make_runtime(**PLANES["zmq"])
    caller = await make_runtime(**PLANES["zmq"])
    v1, state = await start_worker(worker, ns)
    store(state, list(range(2 * BLOCK)))
    name = query_source_endpoint(v1.kv_pub.publisher_id)
    ident = EndpointId(ns, "backend", name)
    subject = Instance.from_json((await caller.discovery().get(ident.instance_key(worker.instance_id))).value).subject
    # the request as a 1.x client sends it: no mark of our client, none of our extras offered
    receiver = await caller.response_streams().receiver()
    stream = StreamState("as-1x", worker.instance_id)
    info = {k: v for k, v in receiver.register(stream)["info"].items()
            if k in ("address", "subject", "context", "stream_type")}
    control = {"id": "as-1x", "request_type": "single_in", "response_type": "many_out",
               "connection_info": {"transport": "tcp_server", "info": orjson.dumps(info).decode()}}
    request = encode_frame(orjson.dumps(control), orjson.dumps(recovery_query(worker.instance_id)))
    assert await caller.request_plane().send(subject, request, 5, stream) == b""
    await until(lambda: stream.finished, 5, "the answer")
    receiver.unregister(stream)
    answers = [a["data"] for a in stream.items]  # our client's reading of a bare answer: the item itself
    assert len(answers) == 1 and set(answers[0]) == {"TreeDump"}
    assert answers[0]["TreeDump"]["last_event_id"] == 1
    assert dump_from_tree(worker.instance_id, answers[0])["blocks"][-1][0] == compute_hashes(
        list(range(2 * BLOCK)), BLOCK)[1][-1]


@pytest.mark.parametrize("planes", ["zmq", "nats"])
async def test_a_process_does_not_hear_its_own_events(make_runtime, ns, planes):
    """Another process hears an event; the process that published it does not (its own KV router would
    decode its own bookings only to ignore them: ~4 % of a busy frontend's samples when it did)."""
    me, other = await make_runtime(**PLANES[planes]), await make_runtime(**PLANES[planes])
    scope = EndpointScope(ns, "backend", "generate")
    heard: dict[str, list[bytes]] = {"me": [], "other": []}
    for name, rt in (("me", me), ("other", other)):
        await rt.event_plane().subscribe(scope, "kv-hit-rate", lambda env, n=name: heard[n].append(env.payload))
    pub = await me.event_plane().publisher(scope, "kv-hit-rate")

    async def send(payload: bytes) -> None:
        sent = pub.publish(payload)
        if sent is not None:
            await sent

    async def other_heard(payload: bytes) -> bool:
        await send(payload)
        return payload in heard["other"]

    await until(lambda: other_heard(b"first"), 10, "the other process's subscription")
    await until(lambda: other_heard(b"last"), 10, "an event after the other's connection was up")
    assert heard["me"] == []


async def test_routers_of_one_process_share_bookings_directly_and_with_other_processes(make_runtime, ns):
    """Two KV routers of one process in front of the same workers (two models they serve) see each other's
    bookings without the event plane; a router of another process sees both over it."""
    from dynamo.frontend.kv_policy import bookings_publisher

    here, there = await make_runtime(**PLANES["zmq"]), await make_runtime(**PLANES["zmq"])
    scope = EndpointScope(ns, "backend", "generate")
    policies = []
    for rt in (here, here, there):
        router = KvRouter(block_size=BLOCK, seed=0,
                          publish_active_sequence=await bookings_publisher(rt.event_plane(), scope))
        policy = KvRouterPolicy(router, rt.event_plane(), runtime=rt)
        await policy.follow_bookings(scope)
        policies.append(policy)
    one, two, far = (p.router for p in policies)
    try:
        prompt = list(range(4 * BLOCK))
        n = 0

        async def far_heard() -> bool:  # events before the far subscriber's handshake are lost
            nonlocal n
            n += 1
            one.select(prompt, [A_WORKER], request_id=f"r{n}")
            return far.worker_load(A_WORKER)["active_requests"] > 0

        await until(far_heard, 10, "the other process's router hearing the bookings")
        assert two.worker_load(A_WORKER)["active_requests"] == n  # every one, at once: no plane between
        for i in range(1, n + 1):
            one.on_finished(f"r{i}")
        assert two.worker_load(A_WORKER)["active_requests"] == 0
        await until(lambda: far.worker_load(A_WORKER)["active_requests"] == 0, 10, "the frees over the plane")
    finally:
        for policy in policies:
            await policy.close()


A_WORKER = 0xA

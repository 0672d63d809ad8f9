"""Engine-side KV events for slot engines (llamacpp): slot_blocks.SlotBlocks names blocks as the router
hashes them, worker_state.WorkerKvState numbers/records them, and a router fed the events (or a dump of
the worker's state) finds exactly the prefixes the slots hold."""

from __future__ import annotations

from dynamo.kv import KvRouter
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.replica_sync import frame
from dynamo.kv.slot_blocks import SlotBlocks
from dynamo.kv.worker_state import WorkerKvState

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_stored_events_use_the_router_hashes_with_the_right_parents():
    sb = SlotBlocks(BS)
    prompt = toks(10)  # two complete blocks and a tail
    sb.extend(0, prompt)
    local, seq = compute_hashes(prompt, BS)
    assert sb.take_events() == [{"stored": {"parent_hash": None, "blocks": [
        {"block_hash": seq[0], "tokens_hash": local[0]}, {"block_hash": seq[1], "tokens_hash": local[1]}]}}]
    # the slot grows by decoding: the third block completes, child of the second
    sb.extend(0, prompt + [50, 51])
    local3, seq3 = compute_hashes(prompt + [50, 51], BS)
    assert sb.take_events() == [{"stored": {"parent_hash": seq[1], "blocks": [
        {"block_hash": seq3[2], "tokens_hash": local3[2]}]}}]
    assert sb.blocks(0) == seq3 and sb.cached_blocks == 3


def test_shared_blocks_are_counted_once_and_removed_with_the_last_holder():
    sb = SlotBlocks(BS)
    system = toks(8)
    a, b = system + toks(4, 100), system + toks(4, 200)
    sb.extend(0, a)
    sb.take_events()
    sb.extend(1, b)  # the system prompt is already stored by slot 0: only b's own block is new
    (ev,) = sb.take_events()
    _, seq_b = compute_hashes(b, BS)
    assert ev["stored"]["parent_hash"] == seq_b[1] and [x["block_hash"] for x in ev["stored"]["blocks"]] == [seq_b[2]]
    assert sb.cached_blocks == 4
    # slot 0 is cut back to the system prompt for a new request: only its private block goes
    sb.truncate(0, 9)
    _, seq_a = compute_hashes(a, BS)
    assert sb.take_events() == [{"removed": {"block_hashes": [seq_a[2]]}}]
    # slot 1 is overwritten by an unrelated prompt: its blocks go, except those slot 0 still holds
    sb.truncate(1, 0)
    assert sb.take_events() == [{"removed": {"block_hashes": [seq_b[2]]}}]
    sb.truncate(0, 0)
    assert sb.take_events() == [{"removed": {"block_hashes": [seq_a[1], seq_a[0]]}}]  # children first
    assert sb.cached_blocks == 0


def test_a_new_run_after_shared_blocks_names_its_parent():
    sb = SlotBlocks(BS)
    sb.extend(0, toks(4))
    sb.take_events()
    sb.extend(1, toks(12))  # block 0 shared, blocks 1-2 new
    (ev,) = sb.take_events()
    _, seq = compute_hashes(toks(12), BS)
    assert ev["stored"]["parent_hash"] == seq[0]
    assert [b["block_hash"] for b in ev["stored"]["blocks"]] == seq[1:]


def test_copy_shares_blocks_without_events_and_clear():
    sb = SlotBlocks(BS)
    sb.extend(0, toks(16))
    sb.extend(1, toks(8, 500))
    sb.take_events()
    sb.copy(0, 1, 9)  # slot 1 takes the first 9 tokens of slot 0 (2 complete blocks)
    (ev,) = sb.take_events()
    assert "removed" in ev and len(ev["removed"]["block_hashes"]) == 2  # slot 1's old blocks
    assert sb.blocks(1) == sb.blocks(0)[:2]
    sb.truncate(0, 0)  # slot 1 still holds the first two
    (ev,) = sb.take_events()
    assert ev["removed"]["block_hashes"] == list(reversed(sb_blocks_of(toks(16))[2:]))
    sb.clear()
    assert sb.take_events() == ["cleared"] and sb.cached_blocks == 0


def sb_blocks_of(tokens: list[int]) -> list[int]:
    return compute_hashes(tokens, BS)[1]


def _feed(router: KvRouter, state: WorkerKvState, sb: SlotBlocks) -> None:
    for data in sb.take_events():
        router.apply_event(state.send(data))


def test_router_sees_what_the_slots_hold():
    router = KvRouter(block_size=BS)
    sent: list[dict] = []
    state = WorkerKvState(7, sent.append, first_event_id=100)
    sb = SlotBlocks(BS)
    sb.clear()
    system = toks(12)
    sb.extend(0, system + toks(5, 100))
    sb.extend(1, system + toks(9, 200))
    _feed(router, state, sb)
    assert [e["event"]["event_id"] for e in sent] == [100, 101, 102]
    assert router.find_matches(system + toks(5, 100)) == {7: 4}
    assert router.find_matches(system + toks(9, 200)) == {7: 5}
    assert router.find_matches(system + toks(8, 300)) == {7: 3}
    sb.truncate(1, 0)
    sb.truncate(0, 13)
    _feed(router, state, sb)
    assert router.find_matches(system + toks(9, 200)) == {7: 3}
    sb.truncate(0, 0)
    _feed(router, state, sb)
    assert router.find_matches(system) == {}


def test_dump_rebuilds_a_late_router_and_replays_newer_events():
    state = WorkerKvState(7, None, first_event_id=0)
    sb = SlotBlocks(BS)
    sb.extend(0, toks(12))
    sb.extend(1, toks(8) + toks(8, 300))
    sb.extend(2, toks(8, 900))
    for data in sb.take_events():
        state.send(data)
    dump = state.dump()
    assert dump["worker_id"] == 7 and dump["last_event_id"] == 2
    late = KvRouter(block_size=BS)
    late.begin_resync(7)
    # an event published after the dump was taken arrives before the dump does: kept while the dump
    # is pending, and replayed after it
    sb.truncate(2, 0)
    (removed,) = [state.send(d) for d in sb.take_events()]
    late.apply_event(removed)
    assert late.apply_dump(7, dump) == 7
    assert late.find_matches(toks(12)) == {7: 3}
    assert late.find_matches(toks(8) + toks(8, 300)) == {7: 4}
    assert late.find_matches(toks(8, 900)) == {}  # removed after the dump, replayed
    # an event older than the dump arrives late: ignored (the dump includes it)
    stale = {"worker_id": 7, "event": {"event_id": 1, "data": {"removed": {"block_hashes": sb.blocks(0)}}}}
    assert late.apply_event(stale) is False
    assert late.find_matches(toks(12)) == {7: 3}


def test_dump_skips_orphans_and_orders_parents_first():
    state = WorkerKvState(1, None, first_event_id=0)
    _, seq = compute_hashes(toks(12), BS)
    local, _ = compute_hashes(toks(12), BS)
    state.send({"stored": {"parent_hash": None, "blocks": [{"block_hash": s, "tokens_hash": l}
                                                           for s, l in zip(seq, local, strict=True)]}})
    state.send({"removed": {"block_hashes": [seq[0]]}})  # an engine that evicts a parent first
    assert state.dump()["blocks"] == []
    state.send({"stored": {"parent_hash": None, "blocks": [{"block_hash": seq[0], "tokens_hash": local[0]}]}})
    assert [b[0] for b in state.dump()["blocks"]] == seq


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_silent_peer_routers_bookings_expire():
    clock = Clock()
    out_a: list[dict] = []
    a = KvRouter(block_size=BS, publish_active_sequence=out_a.append, router_id=0xA, clock=clock, peer_ttl=6)
    b = KvRouter(block_size=BS, router_id=0xB, clock=clock, peer_ttl=6)
    a.select(toks(16), [1], request_id="r1")
    a.select(toks(16, 50), [1], request_id="r2")
    for e in out_a:
        b.apply_active_sequence_event(e)
    assert b.worker_load(1)["active_requests"] == 2
    # A is alive: its heartbeat keeps both bookings
    clock.t = 5
    out_a.clear()
    a.heartbeat()
    (beat,) = out_a
    # a no-op for 1.6.1 (request "" is no router's), with our field beside it
    assert beat == {"request_id": "", "worker": {"worker_id": 0, "dp_rank": 0}, "data": "MarkPrefillCompleted",
                    "router_id": 0xA, "lora_name": None, "heartbeat": {"request_ids": ["r1", "r2"]}}
    b.apply_active_sequence_event(beat)
    clock.t = 10
    assert b.expire_peers() == 0 and b.worker_load(1)["active_requests"] == 2
    # r2's Free got lost: the next heartbeat no longer lists it, so B frees it
    a.on_finished("r2")
    out_a.clear()
    a.heartbeat()
    b.apply_active_sequence_event(out_a[-1])
    assert b.worker_load(1)["active_requests"] == 1
    # A dies (kill -9): nothing more from it; after the TTL its last booking is gone too
    clock.t = 16.5
    assert b.select(toks(16, 900), [1, 2]).worker_id in (1, 2)  # select expires peers lazily
    assert b.worker_load(1)["active_requests"] == 0
    # B's own bookings never expire this way
    b.select(toks(16, 300), [1], request_id="mine")
    clock.t = 100
    assert b.expire_peers() == 0 and b.worker_load(1)["active_requests"] == 1



# what Dynamo 1.6.1's frontend (--router-replica-sync) and its mocker published for one request (observed)
D16_ROUTER, D16_WORKER = 11330970277860350789, 18326327000310449198
D16_ADD = {"events": [{"request_id": "3df7ee72", "worker": {"worker_id": D16_WORKER, "dp_rank": 0},
                       "data": {"AddRequest": {"token_sequence": [8669855453106358303, 17973271997333311307,
                                                                  4802968182366274244, 8236014029926960814],
                                               "track_prefill_tokens": True, "expected_output_tokens": None,
                                               "prefill_load_hint": {"initial_effective_prefill_tokens": 263,
                                                                     "expected_prefill_duration": None}}},
                       "router_id": D16_ROUTER, "lora_name": None}]}
D16_WORKER_MARK = {"events": [{"request_id": "3df7ee72", "worker": {"worker_id": D16_WORKER, "dp_rank": 0},
                               "data": "MarkPrefillCompleted", "router_id": D16_WORKER, "lora_name": None}]}
D16_FREE = {"events": [{"request_id": "3df7ee72", "worker": {"worker_id": D16_WORKER, "dp_rank": 0},
                        "data": "Free", "router_id": D16_ROUTER, "lora_name": None}]}


def test_a_1x_routers_bookings_count_until_freed_and_expire_after_1xs_own_bound():
    clock = Clock()
    r = KvRouter(block_size=64, clock=clock, peer_ttl=6)
    w = D16_WORKER - (1 << 64)  # above i64's maximum: negative, as our code keeps worker ids
    assert r.apply_active_sequence_event(D16_ADD)
    assert r.worker_load(w) == {"active_blocks": 4, "active_tokens": 263, "active_requests": 1}
    # the worker's own mark (its worker id as router id) ends the prompt's prefill
    assert r.apply_active_sequence_event(D16_WORKER_MARK)
    assert r.worker_load(w)["active_tokens"] == 0
    # 1.6.1 sends no heartbeats: its silence is no reason to drop its bookings...
    clock.t = 100
    assert r.expire_peers() == 0 and r.worker_load(w)["active_requests"] == 1
    # ...its Free is (on NATS 1.6.1 sends each event bare, not in a batch)
    assert r.apply_active_sequence_event(D16_FREE["events"][0])
    assert r.worker_load(w)["active_requests"] == 0
    # a booking whose Free never comes lasts as long as 1.x lets it
    r.apply_active_sequence_event(D16_ADD)
    clock.t = 399
    assert r.expire_peers() == 0 and r.worker_load(w)["active_requests"] == 1
    clock.t = 401
    assert r.expire_peers() == 1 and r.worker_load(w)["active_requests"] == 0


def test_malformed_active_sequence_events_are_counted_and_logged_once_a_minute(caplog):
    r = KvRouter(block_size=64)
    bad = {"events": [{"request_id": "x", "worker_id": 1, "router_id": 2, "data": "Free"}]}  # no "worker"
    with caplog.at_level("WARNING", logger="dynamo.kv.router"):
        for _ in range(50):
            assert not r.apply_active_sequence_event(bad)
    assert r.seq_events_rejected == 50
    assert len([m for m in caplog.messages if "active-sequence" in m]) == 1


def test_an_event_is_framed_as_1_6_1_reads_it_on_each_transport():
    event = D16_FREE["events"][0]
    assert frame(event, "zmq") == D16_FREE  # a batch: 1.6.1's ZMQ reader says "missing field `events`" otherwise
    assert frame(event, "nats") == event  # bare: its NATS reader says "missing field `request_id`" to a batch

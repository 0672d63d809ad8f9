"""KV events and load in Dynamo 1.x's shapes, against what 1.6.1's mocker sent
(tests/unit/runtime/data/dynamo16_events.json: a prompt's token ids as its frontend sent them, the kv-events
message its mocker published for that prompt, a kv_metrics message, and a recovery answer)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from dynamo.kv import KvRouter
from dynamo.kv.events import DISK, HOST, EventError, kv_event, removed_data, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.v1_events import (
    FORWARD_PASS_METRICS,
    V1KvNumbering,
    active_load,
    decode_router_events,
    dump_from_tree,
    encode_router_events,
    metrics_from_load,
    query_source_endpoint,
    recovery_query,
)
from dynamo.kv.worker_state import WorkerKvState
from dynamo.runtime.v1_event_wire import decode_envelope, decode_zmq_frames

DATA = json.loads((Path(__file__).parents[1] / "runtime" / "data" / "dynamo16_events.json").read_text())
BLOCK = 64  # the 1.6.1 mocker's
WORKER = 0x59F5A0430FD477B0  # the mocker's instance id in that capture


def mocker_events() -> list[dict]:
    env = decode_zmq_frames([bytes.fromhex(f) for f in DATA["kv_events_frames"]])
    return decode_router_events(env.payload)


def test_our_block_hashes_are_the_1x_mocker_s() -> None:
    """Both routers hash the frontend's token ids: ours must name each block as 1.6.1's mocker does."""
    tokens = DATA["prompt_token_ids"]
    local, seq = compute_hashes(tokens, BLOCK)
    (event,) = mocker_events()
    blocks = event["event"]["data"]["stored"]["blocks"]
    assert len(blocks) == len(tokens) // BLOCK == 6
    assert [b["tokens_hash"] for b in blocks] == local
    assert [b["block_hash"] for b in blocks] == seq


def test_our_router_finds_the_1x_mocker_s_blocks_for_the_repeated_prompt() -> None:
    router = KvRouter(block_size=BLOCK)
    for event in mocker_events():
        assert router.apply_event(event)
    tokens = DATA["prompt_token_ids"]
    assert router.find_matches(tokens) == {WORKER: 6}
    assert router.select(tokens, [WORKER, 7]).worker_id == WORKER


def test_our_events_in_1x_form_round_trip_into_a_router() -> None:
    sent: list[dict] = []
    state = WorkerKvState(41, sent.append, first_event_id=1000)
    numbering = V1KvNumbering(41)
    tokens = list(range(4 * BLOCK))
    local, seq = compute_hashes(tokens, BLOCK)
    state.send(stored_data(None, zip(seq[:2], local[:2], strict=True)))
    state.send(stored_data(seq[1], zip(seq[2:], local[2:], strict=True)))
    state.send(stored_data(None, zip(seq[:1], local[:1], strict=True)), tier=HOST)
    state.send(removed_data(seq[3:]))
    wire = [w for e in sent for w in numbering.translate(e)]
    assert [w["event"]["event_id"] for w in wire] == [1, 2, 3, 4]  # 1.x's own numbering, from 1
    assert [w["storage_tier"] for w in wire] == ["device", "device", "host_pinned", "device"]
    assert wire[0]["event"]["data"]["stored"]["blocks"][0] == {"block_hash": seq[0], "tokens_hash": local[0],
                                                                "mm_extra_info": None}
    decoded = decode_router_events(encode_router_events(wire))
    router = KvRouter(block_size=BLOCK)
    assert all(router.apply_event(e) for e in decoded)
    assert router.find_matches(tokens) == {41: 3}
    cleared = numbering.translate(kv_event(41, 5, "cleared"))  # every tier: one clear per tier in 1.x
    assert [c["storage_tier"] for c in cleared] == ["device", "host_pinned", "disk"]
    assert [c["event"]["event_id"] for c in cleared] == [5, 6, 7] and {c["event"]["data"] for c in cleared} == {"cleared"}
    for c in decode_router_events(encode_router_events(cleared)):
        router.apply_event(c)
    assert router.find_matches(tokens) == {}  # the worker's restart reaches every tier of the router


def test_recovery_answer_of_ours_rebuilds_the_cache_in_a_router() -> None:
    sent: list[dict] = []
    state = WorkerKvState(41, sent.append, first_event_id=7)
    numbering = V1KvNumbering(41)
    a = compute_hashes(list(range(3 * BLOCK)), BLOCK)
    b = compute_hashes(list(range(5000, 5000 + 2 * BLOCK)), BLOCK)
    state.send(stored_data(None, zip(a[1][:2], a[0][:2], strict=True)))
    state.send(stored_data(a[1][1], zip(a[1][2:], a[0][2:], strict=True)))
    state.send(stored_data(None, zip(b[1], b[0], strict=True)))
    state.send(stored_data(None, zip(b[1][:1], b[0][:1], strict=True)), tier=DISK)
    for e in sent:
        numbering.translate(e)
    answer = numbering.tree_dump(state.dump())
    body = answer["TreeDump"]
    assert body["reset_scope"] == "all" and body["last_event_id"] == 4
    assert [e["event"]["event_id"] for e in body["events"]] == [1, 2, 3]  # one event per chain
    # what a 1.x router would read (MessagePack both ways), then ours
    answer = msgspec.msgpack.decode(msgspec.msgpack.encode(answer))
    dump = dump_from_tree(41, answer)
    router = KvRouter(block_size=BLOCK)
    router.apply_dump(41, dump)
    assert router.find_matches(list(range(3 * BLOCK))) == {41: 3}
    assert router.find_matches(list(range(5000, 5000 + 2 * BLOCK))) == {41: 2}
    assert dump["last_event_id"] == 4 and len(dump["tiers"][DISK]) == 1


def test_the_1x_mocker_s_recovery_answer_reads_as_our_dump() -> None:
    item = msgspec.msgpack.decode(bytes.fromhex(DATA["recovery_tree_dump_item"]))
    assert item["complete_final"] is False
    answer = item["data"]
    worker = answer["TreeDump"]["events"][0]["worker_id"]
    dump = dump_from_tree(worker, answer)
    assert dump["last_event_id"] == 2 and len(dump["blocks"]) == 25
    router = KvRouter(block_size=BLOCK)
    assert router.apply_dump(worker, dump) == 25
    assert recovery_query(worker) == DATA["recovery_request"] | {"worker_id": worker}
    with pytest.raises(EventError):
        dump_from_tree(worker, {"TreeDumpFailed": {}})


def test_load_both_ways() -> None:
    env = decode_zmq_frames([bytes.fromhex(f) for f in DATA["kv_metrics_frames"]])
    theirs = msgspec.msgpack.decode(env.payload)
    used = theirs["kv_used_blocks"]
    ours = metrics_from_load(env.payload)
    assert ours == {"worker_id": WORKER, "data": {"worker_stats": {"data_parallel_rank": 0},
                                                  "kv_stats": {"kv_active_blocks": used}}}
    report = {"worker_id": WORKER, "data": {"worker_stats": {"data_parallel_rank": 0},
                                            "kv_stats": {"kv_active_blocks": used, "kv_total_blocks": 99}}}
    payload = active_load(report)
    assert payload is not None
    sent = msgspec.msgpack.decode(payload)
    # 1.6.1's mocker's fields, in its order, with its values for the same load; then our whole report
    assert list(sent)[:len(theirs)] == list(theirs) and {k: sent[k] for k in theirs} == theirs
    assert sent[FORWARD_PASS_METRICS] == report["data"]
    assert metrics_from_load(payload) == report  # our frontends read all of it back
    assert msgspec.msgpack.decode(active_load({"worker_id": 1, "data": {"kv_stats": {}}}))["kv_used_blocks"] is None
    # an id above i64's maximum: unsigned on 1.x's wire, negative where we keep it (its key's hex), both ways
    big = msgspec.msgpack.encode({"worker_id": 0xEE1B89A277927A0B, "dp_rank": 0, "kv_used_blocks": 3})
    assert metrics_from_load(big)["worker_id"] == 0xEE1B89A277927A0B - (1 << 64)
    back = active_load({"worker_id": 0xEE1B89A277927A0B - (1 << 64), "data": {"kv_stats": {"kv_active_blocks": 3}}})
    assert msgspec.msgpack.decode(back)["worker_id"] == 0xEE1B89A277927A0B
    nats = decode_envelope(bytes.fromhex(DATA["nats_kv_metrics"]["data"]))
    assert metrics_from_load(nats.payload)["data"]["kv_stats"] == {"kv_active_blocks": 0}


def test_bad_payloads_are_event_errors() -> None:
    with pytest.raises(EventError):
        decode_router_events(b"\xc1")
    with pytest.raises(EventError):
        decode_router_events(msgspec.msgpack.encode({"worker_id": 1}))
    with pytest.raises(EventError):
        metrics_from_load(msgspec.msgpack.encode([1, 2]))
    assert query_source_endpoint(0x1A82BA1C724DB0) == "worker_kv_query_source_1a82ba1c724db0"

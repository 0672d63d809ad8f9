"""The radix-tree indexer, KV event parsing and the approximate (TTL) indexer."""

import logging

import orjson
import pytest

from dynamo.kv.events import EventError, kv_event, parse_kv_event, removed_data, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.indexer import ApproxKvIndexer, KvIndexer

BS = 4


def blocks_of(tokens):
    """(local hashes, seq hashes, [(block_hash, tokens_hash)]) naming blocks by sequence hash, as the mocker does."""
    local, seq = compute_hashes(tokens, BS)
    return local, seq, list(zip(seq, local, strict=True))


PROMPT = list(range(1, 17))  # 4 blocks
LOCAL, SEQ, PAIRS = blocks_of(PROMPT)


def stored(worker, pairs, parent=None, event_id=1):
    return kv_event(worker, event_id, stored_data(parent, pairs))


def removed(worker, hashes, event_id=2):
    return kv_event(worker, event_id, removed_data(hashes))


def test_store_and_match():
    idx = KvIndexer()
    assert idx.apply_event(stored(1, PAIRS))
    assert idx.apply_event(stored(2, PAIRS[:2]))
    assert idx.find_matches(LOCAL) == {1: 4, 2: 2}
    assert idx.find_matches(LOCAL[:1]) == {1: 1, 2: 1}
    assert idx.find_matches([]) == {}
    other_local, _, _ = blocks_of(list(range(100, 116)))
    assert idx.find_matches(other_local) == {}


def test_store_with_parent_chain():
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS[:2]))
    idx.apply_event(stored(1, PAIRS[2:], parent=SEQ[1]))
    assert idx.find_matches(LOCAL) == {1: 4}
    assert idx.tree.node_count() == 4
    # storing the same blocks again changes nothing
    idx.apply_event(stored(1, PAIRS))
    assert idx.tree.node_count() == 4 and idx.tree.num_blocks(1) == 4


def test_shared_prefix_divergent_tails():
    idx = KvIndexer()
    a_local, _, a_pairs = blocks_of(PROMPT[:8] + [50, 51, 52, 53])
    b_local, _, b_pairs = blocks_of(PROMPT[:8] + [60, 61, 62, 63])
    idx.apply_event(stored(1, a_pairs))
    idx.apply_event(stored(2, b_pairs))
    assert idx.find_matches(a_local) == {1: 3, 2: 2}
    assert idx.find_matches(b_local) == {1: 2, 2: 3}
    assert idx.tree.node_count() == 4  # two shared nodes, two tails


def test_unknown_parent_is_skipped(caplog):
    idx = KvIndexer()
    with caplog.at_level(logging.WARNING):
        assert not idx.apply_event(stored(1, PAIRS[2:], parent=SEQ[1]))
    assert "unknown parent" in caplog.text
    assert idx.find_matches(LOCAL) == {}
    assert idx.tree.node_count() == 0 and idx.tree.workers() == []


def test_remove_blocks():
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS))
    idx.apply_event(stored(2, PAIRS))
    idx.apply_event(removed(1, [SEQ[3], SEQ[2]]))
    assert idx.find_matches(LOCAL) == {1: 2, 2: 4}
    idx.apply_event(removed(2, SEQ))
    assert idx.find_matches(LOCAL) == {1: 2}
    assert idx.tree.node_count() == 2  # nodes nobody holds are pruned


def test_removed_middle_block_breaks_the_prefix():
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS))
    idx.apply_event(removed(1, [SEQ[1]]))
    # block 2 and 3 are still held but unusable without block 1: a contiguous prefix of 1
    assert idx.find_matches(LOCAL) == {1: 1}
    # the worker stores block 1 again: the subtree reconnects
    idx.apply_event(stored(1, [PAIRS[1]], parent=SEQ[0]))
    assert idx.find_matches(LOCAL) == {1: 4}
    assert idx.tree.node_count() == 4


def test_remove_unknown_warns(caplog):
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS[:1]))
    with caplog.at_level(logging.WARNING):
        idx.apply_event(removed(1, [12345]))
        idx.apply_event(removed(7, [12345]))
    assert "not known" in caplog.text
    assert idx.find_matches(LOCAL) == {1: 1}


def test_cleared_and_remove_worker():
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS))
    idx.apply_event(stored(2, PAIRS[:3]))
    idx.apply_event(stored(3, PAIRS[:1]))
    idx.apply_event(kv_event(1, 5, "cleared"))
    assert idx.find_matches(LOCAL) == {2: 3, 3: 1}
    idx.remove_worker(2)
    assert idx.find_matches(LOCAL) == {3: 1}
    assert idx.tree.node_count() == 1
    idx.remove_worker(3)
    idx.remove_worker(99)  # unknown: nothing happens
    assert idx.tree.node_count() == 0 and idx.find_matches(LOCAL) == {}


def test_event_json_bytes_and_bad_events(caplog):
    idx = KvIndexer()
    assert idx.apply_event(orjson.dumps(stored(1, PAIRS)))
    assert idx.apply_event(orjson.dumps(stored(2, PAIRS)).decode())
    with caplog.at_level(logging.WARNING):
        assert not idx.apply_event(b"{not json")
        assert not idx.apply_event({"worker_id": 1})
        assert not idx.apply_event({"worker_id": "x", "event": {"event_id": 1, "data": "cleared"}})
        assert not idx.apply_event({"worker_id": 1, "event": {"event_id": 1, "data": {"bogus": {}}}})
        assert not idx.apply_event({"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"blocks": [{"block_hash": 1}]}}}})
        assert not idx.apply_event({"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {"block_hashes": "x"}}}})
    assert idx.events_rejected == 6 and idx.events_applied == 2
    assert "undecodable KV event" in caplog.text
    assert idx.find_matches(LOCAL) == {1: 4, 2: 4}


def test_parse_shapes():
    ev = parse_kv_event(orjson.dumps(stored(0x1A, PAIRS[:2], parent=None, event_id=2**64 - 1)))
    assert ev.worker_id == 0x1A and ev.event_id == 2**64 - 1 and ev.kind == "stored"
    assert ev.parent_hash is None and [(b.block_hash, b.tokens_hash) for b in ev.blocks] == PAIRS[:2]
    ev = parse_kv_event({"worker_id": 1, "event": {"event_id": 3, "data": {"removed": {"block_hashes": [-1]}}}})
    assert ev.kind == "removed" and ev.block_hashes == (2**64 - 1,)  # signed i64 producers
    assert parse_kv_event({"worker_id": 1, "event": {"event_id": 3, "data": "cleared"}}).kind == "cleared"
    with pytest.raises(EventError):
        parse_kv_event({"worker_id": 1, "event": {"event_id": 3, "data": []}})


def test_event_builders_shape():
    assert stored(7, [(11, 22)], parent=5, event_id=9) == {
        "worker_id": 7,
        "event": {"event_id": 9, "data": {"stored": {"parent_hash": 5, "blocks": [{"block_hash": 11, "tokens_hash": 22}]}}},
    }
    assert removed(7, [11], event_id=10) == {
        "worker_id": 7, "event": {"event_id": 10, "data": {"removed": {"block_hashes": [11]}}}}


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_approx_indexer_ttl_and_refresh():
    clock = FakeClock()
    idx = ApproxKvIndexer(ttl=120, clock=clock)
    idx.process_routing_decision(1, LOCAL, SEQ)
    idx.process_routing_decision(2, LOCAL[:2], SEQ[:2])
    assert idx.find_matches(LOCAL) == {1: 4, 2: 2}
    clock.t += 100
    idx.process_routing_decision(1, LOCAL[:1], SEQ[:1])  # refreshes worker 1's first block only
    clock.t += 30  # 130 s after the first decisions, 30 s after the refresh
    assert idx.find_matches(LOCAL) == {1: 1}
    clock.t += 89
    assert idx.find_matches(LOCAL) == {1: 1}
    clock.t += 1.5
    assert idx.find_matches(LOCAL) == {}
    assert idx.tree.node_count() == 0 and idx.next_expiry() is None


def test_approx_indexer_expiry_boundary_and_remove_worker():
    clock = FakeClock()
    idx = ApproxKvIndexer(ttl=10, clock=clock)
    idx.process_routing_decision(1, LOCAL, SEQ)
    idx.process_routing_decision(2, LOCAL, SEQ)
    assert idx.next_expiry() == 1010.0
    clock.t = 1009.999
    assert idx.expire() == 0
    idx.remove_worker(2)
    assert idx.find_matches(LOCAL) == {1: 4}
    clock.t = 1010.0
    assert idx.expire() == 4  # worker 2's entries were dropped with it, not expired again
    assert idx.find_matches(LOCAL) == {}


def test_approx_indexer_heap_stays_bounded():
    clock = FakeClock()
    idx = ApproxKvIndexer(ttl=10, clock=clock)
    for _ in range(5000):
        idx.process_routing_decision(1, LOCAL, SEQ)
    assert len(idx._heap) <= 4 * 4 + 1024 + 4


def test_many_workers_and_reused_bits():
    """More workers than a machine word: the bitmask of holders grows; a removed worker's bit is reused
    without the newcomer inheriting anything."""
    idx = KvIndexer()
    for w in range(200):
        idx.apply_event(stored(w, PAIRS[: 1 + w % 4]))
    scores = idx.find_matches(LOCAL)
    assert len(scores) == 200 and all(scores[w] == 1 + w % 4 for w in range(200))
    idx.remove_worker(7)
    idx.apply_event(stored(1000, PAIRS[:1]))  # takes worker 7's bit
    scores = idx.find_matches(LOCAL)
    assert 7 not in scores and scores[1000] == 1 and scores[3] == 4
    # the caller's sequence hashes give the same answer
    assert idx.find_matches(LOCAL, SEQ) == scores


def test_json_fast_path_and_the_full_parser_agree():
    """A plain stored event skips building a KvEvent; one with signed (i64) hashes goes through the full
    parser, which reads their u64 bits: both index the same blocks."""
    signed = [(b - (1 << 64) if b >= 1 << 63 else b, t - (1 << 64) if t >= 1 << 63 else t) for b, t in PAIRS]
    assert any(b < 0 or t < 0 for b, t in signed)
    a, b = KvIndexer(), KvIndexer()
    assert a.apply_event(orjson.dumps(stored(1, PAIRS)))
    assert b.apply_event(orjson.dumps(stored(1, signed)))
    assert a.find_matches(LOCAL) == b.find_matches(LOCAL) == {1: 4}
    assert a.apply_event(orjson.dumps(removed(1, [SEQ[2]])))
    assert a.find_matches(LOCAL) == {1: 2}


def test_hashes_beyond_64_bits_are_rejected_not_raised(caplog):
    idx = KvIndexer()
    idx.apply_event(stored(1, PAIRS[:1]))
    big = ('{"worker_id": 1, "event": {"event_id": 3, "data": {"stored": {"parent_hash": %d, '
           '"blocks": [{"block_hash": 5, "tokens_hash": %d}]}}}}' % (SEQ[0], 1 << 64))
    with caplog.at_level(logging.WARNING):
        assert not idx.apply_event(big.encode())
    assert "64 bits" in caplog.text
    assert idx.find_matches(LOCAL) == {1: 1}

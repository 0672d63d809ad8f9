"""KV events with a storage tier: offloaded blocks are indexed apart from resident ones, and the router
credits them at their tier's weight: more than nothing, less than resident blocks."""

from __future__ import annotations

import orjson
import pytest

from dynamo.kv.events import (
    DISK,
    HOST,
    EventError,
    kv_event,
    parse_kv_event,
    removed_data,
    stored_data,
)
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.indexer import KvIndexer
from dynamo.kv.router import KvRouter
from dynamo.kv.worker_state import WorkerKvState

BS = 4
PROMPT = list(range(40))  # 10 blocks


def chain(tokens: list[int], n_blocks: int | None = None) -> dict:
    local, seq = compute_hashes(tokens, BS)
    n = len(seq) if n_blocks is None else n_blocks
    return stored_data(None, list(zip(seq[:n], local[:n], strict=True)))


def seqs(tokens: list[int]) -> list[int]:
    return compute_hashes(tokens, BS)[1]


def test_the_wire_names_the_tier_and_absent_means_device():
    assert "storage_tier" not in kv_event(1, 1, "cleared")
    ev = kv_event(1, 2, chain(PROMPT), HOST)
    assert ev["storage_tier"] == "host_pinned"
    assert parse_kv_event(ev).tier == HOST
    assert parse_kv_event(kv_event(1, 3, chain(PROMPT))).tier == "device"
    # vLLM's medium spellings, inside the event, mean the same
    vllm = {"worker_id": 1, "event": {"event_id": 4, "data": chain(PROMPT), "medium": "CPU_PINNED"}}
    assert parse_kv_event(vllm).tier == HOST
    assert parse_kv_event({**vllm, "event": {**vllm["event"], "medium": "DISK"}}).tier == DISK
    with pytest.raises(EventError, match="unknown storage tier"):
        parse_kv_event({"worker_id": 1, "event": {"event_id": 5, "data": "cleared"}, "storage_tier": "tape"})


@pytest.mark.parametrize("raw", [False, True])
def test_offloaded_blocks_are_not_resident_and_come_back_out_when_evicted(raw):
    idx = KvIndexer()

    def apply(ev):
        return idx.apply_event(orjson.dumps(ev) if raw else ev)

    assert apply(kv_event(7, 1, chain(PROMPT, 2)))  # blocks 0-1 resident
    assert apply(kv_event(7, 2, chain(PROMPT), HOST))  # the whole prompt offloaded to host memory
    assert idx.find_matches([], seqs(PROMPT)) == {7: 2}  # resident prefix only
    assert idx.find_lower_matches(seqs(PROMPT)) == {HOST: {7: 10}}
    # the host tier's LRU drops it: the offloaded prefix is gone, the resident one stays
    assert apply(kv_event(7, 3, removed_data(seqs(PROMPT)), HOST))
    assert idx.find_lower_matches(seqs(PROMPT)) == {}
    assert idx.find_matches([], seqs(PROMPT)) == {7: 2}
    # an unknown tier is refused, never counted as resident
    bad = {**kv_event(7, 4, chain(PROMPT)), "storage_tier": "tape"}
    assert not apply(bad)
    assert idx.find_matches([], seqs(PROMPT)) == {7: 2}


def test_a_vllm_medium_is_never_taken_for_the_device_on_the_fast_path():
    idx = KvIndexer()
    ev = {"worker_id": 3, "event": {"event_id": 1, "data": chain(PROMPT), "medium": "CPU"}}
    assert idx.apply_event(orjson.dumps(ev))
    assert idx.find_matches([], seqs(PROMPT)) == {}
    assert idx.find_lower_matches(seqs(PROMPT)) == {HOST: {3: 10}}


def test_disk_extends_what_host_memory_reaches_and_cleared_without_tier_clears_all():
    idx = KvIndexer()
    idx.apply_event(kv_event(1, 1, chain(PROMPT, 3), HOST))
    idx.apply_event(kv_event(1, 2, chain(PROMPT), DISK))
    lower = idx.find_lower_matches(seqs(PROMPT))
    assert lower == {HOST: {1: 3}, DISK: {1: 10}}
    idx.apply_event(kv_event(1, 3, "cleared", DISK))  # one tier
    assert idx.find_lower_matches(seqs(PROMPT)) == {HOST: {1: 3}}
    idx.apply_event(kv_event(1, 4, "cleared"))  # the worker restarted: every tier
    assert idx.find_lower_matches(seqs(PROMPT)) == {}


def test_the_router_prefers_resident_then_host_then_disk_then_nothing():
    r = KvRouter(block_size=BS, seed=1)
    # worker 1: resident; 2: host memory; 3: disk; 4: nothing
    r.apply_event(kv_event(1, 1, chain(PROMPT)))
    r.apply_event(kv_event(2, 1, chain(PROMPT), HOST))
    r.apply_event(kv_event(3, 1, chain(PROMPT), DISK))
    assert r.select(PROMPT + [99], [1, 2, 3, 4]).worker_id == 1
    assert r.select(PROMPT + [99], [2, 3, 4]).worker_id == 2
    assert r.select(PROMPT + [99], [3, 4]).worker_id == 3
    costs = {c.worker_id: c.prefill_tokens for c in r.last_costs}
    assert costs == {3: 41 - 20, 4: 41}  # 10 blocks at weight 0.5
    assert r.restorable(PROMPT) == {2: 8.0, 3: 5.0}
    # the decision reports resident blocks only (what the engine will not compute at all)
    assert r.select(PROMPT + [99], [2]).overlap_blocks == 0


def test_a_longer_offloaded_prefix_beats_a_shorter_resident_one_only_by_its_credit():
    r = KvRouter(block_size=BS, seed=1)
    r.apply_event(kv_event(1, 1, chain(PROMPT, 2)))  # 2 resident blocks
    r.apply_event(kv_event(2, 1, chain(PROMPT, 2)))
    r.apply_event(kv_event(2, 2, chain(PROMPT), HOST))  # 2 resident + 8 more restorable from host
    assert r.select(PROMPT, [1, 2]).worker_id == 2
    assert r.restorable(PROMPT) == {2: pytest.approx(0.8 * 8)}
    with pytest.raises(ValueError):
        KvRouter(tier_weights={HOST: 1.5})


def test_a_worker_dump_carries_its_tiers_to_a_router_that_starts_late():
    state = WorkerKvState(worker_id=5, first_event_id=10)
    state.send(chain(PROMPT, 2))
    state.send(chain(PROMPT), HOST)
    state.send(removed_data(seqs(PROMPT)[5:]), HOST)
    dump = state.dump()
    assert len(dump["blocks"]) == 2 and len(dump["tiers"][HOST]) == 5
    r = KvRouter(block_size=BS)
    assert r.apply_dump(5, orjson.loads(orjson.dumps(dump))) == 7
    assert r.find_matches(PROMPT) == {5: 2}
    assert r.restorable(PROMPT) == {5: pytest.approx(0.8 * 3)}
    state.send("cleared")
    assert "tiers" not in state.dump() and state.dump()["blocks"] == []


def test_with_many_workers_an_offloaded_prefix_still_counts():
    r = KvRouter(block_size=BS, seed=1)
    workers = list(range(1, 101))  # past the fast pick's threshold
    r.apply_event(kv_event(57, 1, chain(PROMPT), HOST))
    r.apply_event(kv_event(3, 1, chain(PROMPT, 1)))  # one resident block elsewhere
    assert r.select(PROMPT + [99], workers).worker_id == 57


def test_common_prefix_counts_the_shared_tokens_of_lists_and_tuples_alike():
    """Chunks compared as slices and the differing one halved: the count is the token-by-token one, at
    every position a difference can fall (a chunk's edges, inside it, none at all), for tuples (host-tier
    keys) against lists (prompts)."""
    import random

    from dynamo.engines.llamacpp.host_tier import common_prefix

    rng = random.Random(7)
    base = [rng.randrange(50_000) for _ in range(300)]
    for cut in (0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 200, 299, 300):
        other = base[:cut] + [50_001] + base[cut + 1:] if cut < 300 else list(base)
        for a, b in ((base, other), (tuple(base), other), (tuple(base), tuple(other)), (base[:cut], other)):
            assert common_prefix(a, b) == min(cut, len(a)), (cut, type(a), type(b))

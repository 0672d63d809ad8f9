"""The tie-break by where a prefix was last routed (kv/homes.py): it decides only between workers of equal
cost, follows the longest remembered prefix, forgets a worker that left, and stays bounded."""

from __future__ import annotations

from dynamo.kv import KvRouter
from dynamo.kv.hashing import compute_block_hashes, compute_seq_hashes
from dynamo.kv.homes import PrefixHomes, checkpoints

BS = 4


def prompt(group: int, tail: int, blocks: int = 16) -> list[int]:
    return [group * 10_000 + i for i in range(blocks * BS)] + [tail * 7 + k for k in range(BS)]


def test_checkpoints_are_powers_of_two_and_the_whole():
    assert checkpoints(0) == []
    assert checkpoints(1) == [1]
    assert checkpoints(5) == [1, 2, 4, 5]
    assert checkpoints(8) == [1, 2, 4, 8]


def test_a_group_seen_before_goes_home_when_the_workers_cost_the_same():
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=1)
    workers = [1, 2, 3, 4]
    homes = {}
    for g in range(8):
        d = r.select(prompt(g, 0), workers, request_id=f"{g}-0")
        r.on_finished(f"{g}-0")  # finished, and (say) evicted: the engines report nothing
        homes[g] = d.worker_id
    for g in range(8):  # every worker idle and holding nothing: each group's next request goes home
        for t in range(1, 4):
            d = r.select(prompt(g, t), workers, request_id=f"{g}-{t}")
            r.on_finished(f"{g}-{t}")
            assert d.worker_id == homes[g]


def test_the_cost_still_decides_a_busy_home_loses_to_an_idle_worker():
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=1)
    first = r.select(prompt(1, 0), [1, 2], request_id="a").worker_id
    r.on_finished("a")
    r.add_request("busy", [99_000 + i for i in range(200)], first)  # something else keeps the home busy
    assert r.select(prompt(1, 1), [1, 2]).worker_id != first


def test_the_longest_remembered_prefix_wins():
    h = PrefixHomes()
    h.record([1, 2, 3, 4, 5, 6, 7, 8], 10)  # checkpoints at blocks 1, 2, 4, 8
    h.record([1, 2, 3, 4, 50, 60, 70, 80], 20)  # shares 4 blocks: its checkpoints 1, 2, 4 now say 20
    assert h.pick([1, 2, 3, 4, 5, 6, 7, 8], {10, 20}) == 10  # the whole prompt was last sent to 10
    assert h.pick([1, 2, 3, 4, 9, 9, 9, 9], {10, 20}) == 20  # shares only blocks up to 4: 20 was last
    assert h.pick([1, 2, 3, 4, 5, 6, 7, 8], {20, 30}) == 20  # 10 not among the tied: the next longest
    assert h.pick([7, 7], {10, 20}) is None


def test_a_worker_that_left_is_forgotten_and_the_memory_is_bounded():
    r = KvRouter(block_size=BS, seed=1)
    w = r.select(prompt(3, 0), [1, 2], request_id="a").worker_id
    r.on_finished("a")
    seq = compute_seq_hashes(compute_block_hashes(prompt(3, 1), BS))
    assert r.homes is not None and r.homes.pick(seq, {1, 2}) == w
    r.remove_worker(w)
    assert r.homes.pick(seq, {1, 2}) is None
    h = PrefixHomes(capacity=5)
    for i in range(100):
        h.record([i], i)
    assert len(h) == 5 and h.pick([99], {99}) == 99 and h.pick([0], {0}) is None


def test_the_bound_is_32k_entries_unless_the_environment_says_otherwise(monkeypatch):
    """32,768 entries (4 MB) by default: 131,072 took half an hour of unique prompts to fill in a first soak."""
    from dynamo.bounds import sizes

    monkeypatch.delenv("DYN_ROUTER_PREFIX_HOMES_SIZE", raising=False)
    assert PrefixHomes().capacity == 32768
    monkeypatch.setenv("DYN_ROUTER_PREFIX_HOMES_SIZE", "7")
    h = PrefixHomes()
    for i in range(20):
        h.record([i], 1)
    assert h.capacity == 7 and len(h) == 7 and sizes()["kv_prefix_homes"] >= 7
    monkeypatch.setenv("DYN_ROUTER_PREFIX_HOMES_SIZE", "lots")
    assert PrefixHomes().capacity == 32768  # warned about, the default used

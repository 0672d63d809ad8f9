"""The router's per-worker tracking, the cost function, selection and sampling, and KvRouter end to end."""

import math
import random
from collections import Counter

import pytest

from dynamo.kv.events import kv_event, removed_data, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.router import KvRouter
from dynamo.kv.scheduler import (
    ActiveSequences,
    WorkerCost,
    compute_costs,
    select_worker,
    softmax_probabilities,
)

BS = 4


def publish_prefix(router, worker, tokens):
    local, seq = compute_hashes(tokens, router.block_size)
    router.apply_event(kv_event(worker, 1, stored_data(None, list(zip(seq, local, strict=True)))))


# -- ActiveSequences ------------------------------------------------------------------------------
def test_active_sequences_accounting():
    s = ActiveSequences()
    s.add_request("a", [1, 2, 3], prefill_tokens=10)
    s.add_request("b", [1, 2, 9], prefill_tokens=4)
    assert s.active_blocks == 4  # 1 and 2 are shared
    assert s.active_tokens == 14
    assert s.new_blocks([1, 5, 9, 6]) == 2
    assert s.mark_prefill_completed("a")
    assert not s.mark_prefill_completed("a")  # only once
    assert s.active_tokens == 4
    assert s.free("b")
    assert s.active_blocks == 3 and s.active_tokens == 0
    assert not s.free("b")
    assert s.free("a")
    assert s.active_blocks == 0 and s.block_refs == {} and s.requests == {}


def test_free_before_first_token_releases_prefill():
    s = ActiveSequences()
    s.add_request("a", [1], prefill_tokens=7)
    s.free("a")
    assert s.active_tokens == 0


# -- cost ------------------------------------------------------------------------------------------
def test_cost_formula():
    busy = ActiveSequences()
    busy.add_request("x", [100, 101, 102], prefill_tokens=8)  # 3 active blocks, 8 tokens to prefill
    trackers = {2: busy}
    request_blocks = [1, 2, 3, 4, 5]  # 18 tokens: 4 full blocks + a partial one
    costs = compute_costs([1, 2], {1: 3, 2: 1}, request_blocks, isl=18, block_size=BS,
                          overlap_score_weight=1.0, trackers=trackers)
    c1, c2 = costs
    # worker 1: prefill 18 - 3*4 = 6 tokens; decode = 5 new blocks + 0 active
    assert (c1.prefill_tokens, c1.decode_blocks, c1.logit) == (6, 5, 6 / 4 + 5)
    # worker 2: prefill 18 - 4 + 8 = 22 tokens; decode = 5 new blocks + 0: "x" is still prefilling, charged
    # in the prefill term only
    assert (c2.prefill_tokens, c2.decode_blocks, c2.logit) == (22, 5, 22 / 4 + 5)
    # once "x" produced its first token its 3 blocks are decode load and its 8 tokens are no longer pending
    busy.mark_prefill_completed("x")
    c2 = compute_costs([2], {2: 1}, request_blocks, 18, BS, 1.0, trackers)[0]
    assert (c2.prefill_tokens, c2.decode_blocks, c2.logit) == (14, 8, 14 / 4 + 8)
    # the weight scales the prefill term only
    w2 = compute_costs([1], {1: 3}, request_blocks, 18, BS, 2.0, trackers)[0]
    assert w2.logit == 2.0 * 6 / 4 + 5
    w0 = compute_costs([1], {1: 3}, request_blocks, 18, BS, 0.0, trackers)[0]
    assert w0.logit == 5


def test_decode_blocks_count_shared_active_blocks_once():
    t = ActiveSequences()
    t.add_request("x", [1, 2], prefill_tokens=0)
    t.mark_prefill_completed("x")
    t.add_request("y", [1, 2, 5], prefill_tokens=0)
    t.mark_prefill_completed("y")
    c = compute_costs([1], {}, [1, 2, 3], isl=12, block_size=BS, overlap_score_weight=1.0, trackers={1: t})[0]
    assert c.decode_blocks == 1 + 3  # block 3 new; 1, 2 and 5 active, 1 and 2 once though both hold them
    t.free("y")
    c = compute_costs([1], {}, [1, 2, 3], isl=12, block_size=BS, overlap_score_weight=1.0, trackers={1: t})[0]
    assert c.decode_blocks == 1 + 2


def cost(w, logit):
    return WorkerCost(w, 0, 0, 0, logit)


def test_argmin_and_random_tie_break():
    rng = random.Random(0)
    assert select_worker([cost(1, 5.0), cost(2, 3.0), cost(3, 4.0)], 0.0, rng).worker_id == 2
    picks = Counter(select_worker([cost(1, 3.0), cost(2, 3.0), cost(3, 4.0)], 0.0, rng).worker_id
                    for _ in range(3000))
    assert set(picks) == {1, 2}
    assert abs(picks[1] - picks[2]) < 300
    # a tie within rounding error is a tie
    a, b = 0.1 + 0.2, 0.3
    assert a != b
    picks = Counter(select_worker([cost(1, a), cost(2, b)], 0.0, rng).worker_id for _ in range(200))
    assert set(picks) == {1, 2}
    with pytest.raises(ValueError):
        select_worker([], 0.0, rng)


def test_softmax_probabilities():
    assert softmax_probabilities([2.0, 2.0, 2.0], 1.0) == pytest.approx([1 / 3] * 3)
    p = softmax_probabilities([1.0, 3.0], 1.0)
    # normalised by the range (2): x = -0.5, -1.5 -> p = softmax
    e = [math.exp(-0.5), math.exp(-1.5)]
    assert p == pytest.approx([e[0] / sum(e), e[1] / sum(e)])
    # lower temperature -> sharper
    assert softmax_probabilities([1.0, 3.0], 0.1)[0] > 0.99
    # higher temperature -> flatter
    assert softmax_probabilities([1.0, 3.0], 100.0)[0] == pytest.approx(0.5, abs=0.01)


def test_softmax_sampling_distribution_seeded():
    rng = random.Random(1234)
    costs = [cost(1, 10.0), cost(2, 12.0), cost(3, 20.0)]
    probs = softmax_probabilities([c.logit for c in costs], 0.5)
    n = 20000
    picks = Counter(select_worker(costs, 0.5, rng).worker_id for _ in range(n))
    for c, p in zip(costs, probs, strict=True):
        assert picks[c.worker_id] / n == pytest.approx(p, abs=0.015)
    assert picks[1] > picks[2] > picks[3]


# -- KvRouter ----------------------------------------------------------------------------------------
def test_router_follows_cached_prefix():
    r = KvRouter(block_size=BS, seed=0)
    prompt = list(range(1, 33))  # 8 blocks
    publish_prefix(r, 2, prompt[:24])
    publish_prefix(r, 3, prompt[:8])
    d = r.select(prompt, [1, 2, 3])
    assert d == (2, 6)
    worker, overlap = d
    assert r.find_matches(prompt) == {2: 6, 3: 2}


def test_router_spreads_load_without_cache():
    r = KvRouter(block_size=BS, seed=0)
    chosen = []
    for i in range(4):
        prompt = [1000 * i + j for j in range(16)]
        chosen.append(r.select(prompt, [1, 2, 3, 4], request_id=f"r{i}").worker_id)
    assert sorted(chosen) == [1, 2, 3, 4]  # in-flight load pushes each one elsewhere
    assert all(r.worker_load(w)["active_requests"] == 1 for w in (1, 2, 3, 4))


def test_router_tracks_prefill_and_decode_load():
    r = KvRouter(block_size=BS, seed=0)
    prompt = list(range(1, 19))  # 4 full blocks + partial
    w, _ = r.select(prompt, [1], request_id="a")
    assert r.worker_load(1) == {"active_blocks": 5, "active_tokens": 18, "active_requests": 1}
    r.on_first_token("a")
    assert r.worker_load(1)["active_tokens"] == 0
    assert r.worker_load(1)["active_blocks"] == 5
    r.on_finished("a")
    assert r.worker_load(1) == {"active_blocks": 0, "active_tokens": 0, "active_requests": 0}
    r.on_finished("a")  # twice: harmless
    r.on_first_token("unknown")


def test_router_overlap_reduces_prefill_cost():
    r = KvRouter(block_size=BS, seed=0, clock=lambda: 0.0)  # no prefill rate measured: all pending
    prompt = list(range(1, 33))
    publish_prefix(r, 1, prompt)  # all 8 blocks cached on 1
    # worker 1 is busier (one 16-token request decoding, 4 blocks, and one of 16 tokens in prefill) but
    # holds the prefix
    r.select([500 + i for i in range(16)], [1], request_id="decoding")
    r.on_first_token("decoding")
    r.select([700 + i for i in range(16)], [1], request_id="busy")
    d = r.select(prompt, [1, 2], request_id="new")
    costs = {c.worker_id: c for c in r.last_costs}
    # the prefilling request counts in the prefill term, the decoding one in the decode term
    assert costs[1].prefill_tokens == 0 + 16 and costs[1].decode_blocks == 8 + 4
    assert costs[2].prefill_tokens == 32 and costs[2].decode_blocks == 8
    # 16/4 + 12 == 32/4 + 8: a tie, either may win
    assert costs[1].logit == 16 and costs[2].logit == 16
    assert d.worker_id in (1, 2) and d.overlap_blocks == (8 if d.worker_id == 1 else 0)


def test_router_weight_changes_the_decision():
    prompt = list(range(1, 33))
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0, clock=lambda: 0.0)
    publish_prefix(r, 1, prompt)
    r.select([500 + i for i in range(16)], [1], request_id="decoding")
    r.on_first_token("decoding")
    r.select([700 + i for i in range(16)], [1], request_id="busy")
    assert r.select(prompt, [1, 2]).worker_id == 1  # 2*16/4+12 = 20 < 2*32/4+8 = 24
    r = KvRouter(block_size=BS, overlap_score_weight=0.5, seed=0, clock=lambda: 0.0)
    publish_prefix(r, 1, prompt)
    r.select([500 + i for i in range(16)], [1], request_id="decoding")
    r.on_first_token("decoding")
    r.select([700 + i for i in range(16)], [1], request_id="busy")
    assert r.select(prompt, [1, 2]).worker_id == 2  # 0.5*16/4+12 = 14 > 0.5*32/4+8 = 12


def test_router_events_removal_and_worker_removal():
    r = KvRouter(block_size=BS, seed=0)
    prompt = list(range(1, 17))
    local, seq = compute_hashes(prompt, BS)
    r.apply_event(kv_event(5, 1, stored_data(None, list(zip(seq, local, strict=True)))))
    assert r.select(prompt, [4, 5]).overlap_blocks == 4
    r.apply_event(kv_event(5, 2, removed_data(seq[2:])))
    assert r.find_matches(prompt) == {5: 2}
    r.select(prompt, [5], request_id="q")
    r.remove_worker(5)
    assert r.find_matches(prompt) == {}
    assert r.worker_load(5)["active_requests"] == 0
    r.on_finished("q")  # after the worker went away: harmless
    assert not r.apply_event(b"garbage")


def test_router_hit_rate_events():
    events = []
    r = KvRouter(block_size=BS, seed=0, publish_hit_rate=events.append)
    prompt = list(range(1, 19))
    publish_prefix(r, 7, prompt[:8])
    r.select(prompt, [7])
    assert events == [{"worker_id": 7, "isl_blocks": 4, "overlap_blocks": 2}]


def test_router_approx_mode():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    r = KvRouter(block_size=BS, use_kv_events=False, seed=3, clock=clock, approx_ttl=120)
    prompt = list(range(1, 33))
    first, overlap = r.select(prompt, [1, 2, 3])
    assert overlap == 0
    # the approximate indexer now believes the prompt is cached on `first`
    again = r.select(prompt + [99, 98, 97, 96], [1, 2, 3])
    assert again == (first, 8)
    assert not r.apply_event(kv_event(2, 1, stored_data(None, [(1, 2)])))  # events are ignored
    clock.t = 121
    assert r.select(prompt, [1, 2, 3]).overlap_blocks == 0  # expired (and re-cached by this decision)
    clock.t = 200
    assert r.find_matches(prompt) != {}


def test_router_replica_sync():
    out_a, out_b = [], []
    a = KvRouter(block_size=BS, seed=0, publish_active_sequence=out_a.append, router_id=0xA)
    b = KvRouter(block_size=BS, seed=1, publish_active_sequence=out_b.append, router_id=0xB)
    prompt = list(range(1, 17))
    w, _ = a.select(prompt, [1, 2], request_id="r1")
    a.on_first_token("r1")
    assert [e["data"] if isinstance(e["data"], str) else list(e["data"]) for e in out_a] == [
        ["AddRequest"], "MarkPrefillCompleted"]
    add = out_a[0]
    assert add["request_id"] == "r1" and add["worker"] == {"worker_id": w, "dp_rank": 0} and add["router_id"] == 0xA
    assert add["data"]["AddRequest"]["isl"] == 16
    assert add["data"]["AddRequest"]["prefill_load_hint"]["initial_effective_prefill_tokens"] == 16
    assert len(add["data"]["AddRequest"]["token_sequence"]) == 4
    for event in out_a:
        assert b.apply_active_sequence_event(event)
    assert not a.apply_active_sequence_event(out_a[0])  # own echo ignored
    assert b.worker_load(w) == {"active_blocks": 4, "active_tokens": 0, "active_requests": 1}
    # B now avoids the worker A loaded
    other = b.select(list(range(100, 116)), [1, 2]).worker_id
    assert other != w
    a.on_finished("r1")
    b.apply_active_sequence_event(out_a[-1])
    assert b.worker_load(w)["active_requests"] == 0
    assert not b.apply_active_sequence_event(b"{}")
    assert b.seq_events_rejected == 1


def test_a_peers_partial_last_block_is_booked_as_the_peer_books_it():
    out_a: list[dict] = []
    a = KvRouter(block_size=BS, seed=0, publish_active_sequence=out_a.append, router_id=0xA)
    b = KvRouter(block_size=BS, seed=1, router_id=0xB)
    w = a.select(list(range(1, 11)), [1], request_id="r1").worker_id  # two full blocks and a partial one
    (event,) = out_a
    assert len(event["data"]["AddRequest"]["token_sequence"]) == 2  # full blocks only, as 1.x
    b.apply_active_sequence_event({"events": [event]})  # (as a batch, the way it travels on ZMQ)
    assert b.worker_load(w) == a.worker_load(w) == {"active_blocks": 3, "active_tokens": 10, "active_requests": 1}


def test_router_validation():
    with pytest.raises(ValueError):
        KvRouter(block_size=0)
    with pytest.raises(ValueError):
        KvRouter(temperature=-1)
    with pytest.raises(ValueError):
        KvRouter().select([1, 2, 3], [])


def test_router_temperature_samples():
    r = KvRouter(block_size=BS, temperature=1.0, seed=5)
    prompt = list(range(1, 33))
    publish_prefix(r, 1, prompt)
    picks = Counter(r.select(prompt, [1, 2]).worker_id for _ in range(2000))
    # logits: worker 1 = 0 + 8 = 8, worker 2 = 32/4 + 8 = 16; range 8 -> p1 = 1 / (1 + e^-1)
    assert picks[1] / 2000 == pytest.approx(1 / (1 + math.exp(-1)), abs=0.03)


def test_router_add_request_direct():
    r = KvRouter(block_size=BS, seed=0)
    r.add_request("d", list(range(8)), worker_id=9)
    assert r.worker_load(9)["active_blocks"] == 2
    r.on_finished("d")
    assert r.worker_load(9)["active_blocks"] == 0


# -- the fast paths of a decision ------------------------------------------------------------------
def test_shared_prefix_agrees_with_counting_every_block():
    """Request blocks are prefix-closed (sequence hashes, then a private tail): the binary search over
    them gives what counting each block would, and the heads / block counts stay in step."""
    rng = random.Random(3)
    groups = [compute_hashes(list(range(g * 1000, g * 1000 + 40)), BS)[1] for g in range(4)]
    for trial in range(200):
        s = ActiveSequences()
        live = []
        for i in range(rng.randrange(0, 6)):
            g = rng.choice(groups)
            blocks = g[: rng.randrange(0, len(g) + 1)] + [rng.getrandbits(64)]
            s.add_request(f"r{i}", blocks, 10)
            if rng.random() < 0.5:
                s.mark_prefill_completed(f"r{i}")
            live.append(f"r{i}")
        for rid in rng.sample(live, rng.randrange(0, len(live) + 1)):
            s.free(rid)
        g = rng.choice(groups)
        request = g[: rng.randrange(0, len(g) + 1)] + ([rng.getrandbits(64)] if trial % 2 else [])
        assert len(request) - s.new_blocks(request) == s.shared_prefix(request)
        for hint in range(len(request) + 2):  # a wrong guess costs lookups, never the answer
            assert s.shared_prefix(request, hint) == s.shared_prefix(request)
        assert s.num_blocks == len(s.block_refs) == s.active_blocks
        assert set(s.heads) == {r.blocks[0] for r in s.requests.values() if r.blocks}
        costs = compute_costs([1], {}, request, 16 * len(request), BS, 1.0, {1: s})
        decoding = {b for r in s.requests.values() if not r.prefilling for b in r.blocks}
        assert s.decoding_blocks == len(s.decode_refs) == len(decoding)
        assert costs[0].decode_blocks == s.new_blocks(request) + len(decoding)


def test_cost_table_reads_like_a_list_of_worker_costs():
    t = ActiveSequences()
    t.add_request("x", [7, 8], prefill_tokens=4)
    costs = compute_costs([1, 2, 3], {2: 2}, [7, 8, 9], 12, BS, 2.0, {1: t})
    assert len(costs) == 3 and [c.worker_id for c in costs] == [1, 2, 3]
    # worker 1: blocks 7 and 8 are in flight there (computed by the time this one runs), 4 tokens pending;
    # "x" still prefilling adds no decode blocks
    assert costs[0] == WorkerCost(1, 0, 4 + 4, 1, 2.0 * 8 / 4 + 1)
    assert costs[1] == WorkerCost(2, 2, 4, 3, 2.0 * 4 / 4 + 3)
    assert costs[-1].worker_id == 3 and costs[1:] == [costs[1], costs[2]]
    assert select_worker(costs, 0.0, random.Random(0)).worker_id == 2
    t.mark_prefill_completed("x")  # now decoding: its 2 blocks are load, nothing pending
    costs = compute_costs([1, 2, 3], {2: 2}, [7, 8, 9], 12, BS, 2.0, {1: t})
    assert costs[0] == WorkerCost(1, 0, 4, 1 + 2, 2.0 * 4 / 4 + 3)


# -- many workers: the decision visits only the workers the prompt touches (scheduler.fast_pick) ---------

class _Recorder:
    """An rng whose choice() records the tie set it was offered."""

    def __init__(self) -> None:
        self.offered: list = []

    def choice(self, seq):
        self.offered = list(seq)
        return seq[0]


@pytest.mark.parametrize("seed", range(6))
def test_fast_pick_chooses_among_exactly_the_workers_the_full_pass_would(seed):
    """Random loads, cached prefixes and in-flight prefixes on 150 workers: the fast pick offers the
    random tie-break exactly the workers with the lowest logit of the full pass (compute_costs)."""
    from dynamo.kv.scheduler import compute_costs, fast_pick

    rng = random.Random(seed)
    bs, weight = 4, rng.choice([0.5, 1.0, 2.0])
    r = KvRouter(block_size=bs, overlap_score_weight=weight, seed=seed)
    workers = list(range(1, 151))
    groups = [[g * 1000 + i for i in range(rng.choice([8, 16, 24]))] for g in range(6)]
    for w in rng.sample(workers, 40):  # cached prefixes
        publish_prefix(r, w, rng.choice(groups)[: bs * rng.randint(1, 4)])
    n = 0
    for w in rng.sample(workers, 60):  # requests in flight, some sharing a group's prefix, some prefilled
        for _ in range(rng.randint(1, 3)):
            n += 1
            prompt = rng.choice(groups) + [rng.randrange(10**6) for _ in range(rng.randint(0, 9))]
            r.add_request(f"r{n}", prompt, w, overlap_blocks=rng.randint(0, 2))
            if rng.random() < 0.5:
                r.on_first_token(f"r{n}")
    for w in workers[:5]:  # idle workers the router has never booked anything on
        r._loads.update(w, r.trackers.get(w))
    for trial in range(30):
        prompt = rng.choice(groups) + [rng.randrange(10**6) for _ in range(rng.randint(0, 12))]
        if trial % 5 == 0:
            prompt = [rng.randrange(10**6) for _ in range(17)]  # touches nobody
        cands = rng.sample(workers, rng.randint(100, 150))
        for w in cands:
            if w not in r._loads.base:
                r._loads.update(w, r.trackers.get(w))
        local, seq = compute_hashes(prompt, bs)
        overlaps = r.indexer.find_matches(local, seq)
        blocks = r._request_blocks(seq, len(prompt))
        full = compute_costs(cands, overlaps, blocks, len(prompt), bs, weight, r.trackers)
        best = min(full.logits)
        want = {c.worker_id for c in full if c.logit <= best + 1e-9 * max(1.0, abs(best))}
        rec = _Recorder()
        picked = fast_pick(cands, overlaps, blocks, len(prompt), bs, weight, r.trackers, r._heads, r._loads, rec)
        got = {c.worker_id if isinstance(c, WorkerCost) else c for c in rec.offered}
        assert got == want
        chosen = {c.worker_id: c for c in full}[picked.choice.worker_id]
        assert picked.choice == chosen  # the same numbers as the full pass
        touched = set(overlaps) | (r._heads.get(blocks[0], set()) if blocks else set())
        assert {c.worker_id for c in picked.evaluated} <= touched  # nobody else was costed one by one


def test_router_with_many_workers_spreads_idle_ties_and_keeps_the_index_true():
    r = KvRouter(block_size=BS, seed=3)
    workers = list(range(100))
    picks = [r.select([7000 + i + 100 * k for i in range(8)], workers, request_id=f"q{k}").worker_id for k in range(100)]
    assert len(set(picks)) == 100  # every request to a different idle worker: the least loaded wins
    for k in range(100):
        r.on_finished(f"q{k}")
    assert set(r._loads.buckets) == {0.0} and r._heads == {}
    r.remove_worker(5)
    assert 5 not in r._loads.base


# -- requests in flight: a prefix routed but not yet reported ------------------------------------------

def test_a_prefix_routed_but_not_yet_reported_brings_the_next_request_to_the_same_worker():
    """The first request of a prefix is still prefilling on one worker, so no KV event has said it is
    cached anywhere, and the other worker is decoding something else; the second request with that
    prefix follows the first (it waits for that prefill and reuses it), where before it saw a miss
    everywhere and went to the other worker to compute the prefix a second time."""
    system = list(range(1000, 1064))  # 16 blocks of 4
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0)
    first = r.select(system + [1, 2, 3, 4], [1, 2], request_id="a")
    other = 3 - first.worker_id
    r.add_request("decoding", [7000 + i for i in range(40)], other)  # 10 blocks, prefilled already
    r.on_first_token("decoding")
    second = r.select(system + [5, 6, 7, 8], [1, 2], request_id="b")
    assert second.worker_id == first.worker_id
    assert second.overlap_blocks == 0  # nothing reported yet: the hit-rate event says so
    costs = {c.worker_id: c for c in r.last_costs}
    # there: its own 4 tokens to prefill after the 68 the first request has pending
    assert costs[first.worker_id].prefill_tokens == 4 + 68
    assert costs[other].prefill_tokens == 68
    # booked with only its own tail pending, so a third request sees 68 + 4 there, not 68 + 68
    assert r.worker_load(first.worker_id)["active_tokens"] == 68 + 4


def test_a_worker_busy_with_the_prefix_still_loses_to_an_idle_one_when_overloaded():
    """The credit is for the blocks, not the queue: with enough pending prefill on the worker computing
    the prefix (here three long unrelated prompts), the idle worker is cheaper."""
    system = list(range(1000, 1064))
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0)
    first = r.select(system + [1, 2, 3, 4], [1, 2], request_id="a")
    other = 3 - first.worker_id
    for i in range(3):
        r.add_request(f"long{i}", [50_000 + 1000 * i + j for j in range(200)], first.worker_id)
    second = r.select(system + [5, 6, 7, 8], [1, 2], request_id="b")
    assert second.worker_id == other


def test_the_credit_ends_with_the_request_and_the_reported_blocks_take_over():
    system = list(range(1000, 1064))
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0)
    first = r.select(system + [1, 2, 3, 4], [1, 2], request_id="a")
    r.on_first_token("a")
    r.on_finished("a")  # gone, and (say) evicted before it was ever reported: no credit left
    picks = {r.select(system + [9, 9, 9, i], [1, 2]).worker_id for i in range(40)}
    # a plain miss everywhere again: the tie goes to where the prefix was last sent (homes.py) ...
    assert picks == {first.worker_id}
    plain = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0, prefix_homes=False)
    plain.select(system + [1, 2, 3, 4], [1, 2], request_id="a")
    plain.on_finished("a")
    # ... or, without that memory, spreads
    assert {plain.select(system + [9, 9, 9, i], [1, 2]).worker_id for i in range(40)} == {1, 2}
    publish_prefix(r, first.worker_id, system)  # reported now
    assert r.select(system + [5, 6, 7, 8], [1, 2]).worker_id == first.worker_id


# -- a prefill in progress: what is left of it -----------------------------------------------------------

def test_a_prefill_nearly_done_on_the_worker_holding_the_prefix_is_waited_for():
    """Worker 1 holds a group's system prompt and is prefilling a long unrelated prompt; worker 2 is idle.
    Just after that prompt was routed, a request of the group goes to worker 2 (computing the system prompt
    there is cheaper than waiting behind a whole prefill).  Once worker 1 has measured its prefill rate
    and most of that prefill is behind it, the request goes to worker 1, where only its own tail is left;
    before, the router counted the whole prompt as pending until its first token came and sent such
    requests to compute the prefix again elsewhere (the decision log's ``elsewhere`` class, 5-11 s each
    on a loaded CPU against about 1 s for a hit)."""
    now = [0.0]
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0, clock=lambda: now[0])
    system = list(range(1000, 1128))  # 32 blocks of 4
    publish_prefix(r, 1, system)
    # worker 1's speed: a 400-token prompt's first token 1 s after it was routed there
    r.add_request("warm", [5000 + i for i in range(400)], 1)
    now[0] = 1.0
    r.on_first_token("warm")
    r.on_finished("warm")
    assert r.trackers[1].prefill_rate == 400.0
    now[0] = 10.0
    r.add_request("cold", [9000 + i for i in range(300)], 1)  # prefilling on worker 1 from t = 10
    group = system + [1, 2, 3, 4, 5, 6, 7, 8]
    assert r.select(group, [1, 2]).worker_id == 2  # just routed: all 300 tokens ahead of it
    now[0] = 10.625  # 250 of its 300 tokens done, by worker 1's rate
    assert r.select(group, [1, 2]).worker_id == 1
    costs = {c.worker_id: c for c in r.last_costs}
    assert costs[1].prefill_tokens == 8 + 50 and costs[2].prefill_tokens == 136
    now[0] = 30.0  # overdue: nothing more is counted than the whole prompt, and never less than 0
    assert r.trackers[1].prefill_progress(now[0]) == 300


def test_the_rate_is_measured_on_the_oldest_prefill_only():
    s = ActiveSequences()
    s.add_request("a", [1], prefill_tokens=100, now=0.0)
    s.add_request("b", [2], prefill_tokens=100, now=0.5)  # waits behind a
    assert s.mark_prefill_completed("a", now=1.0)  # 100 tokens in 1 s
    assert s.prefill_rate == 100.0
    assert s.prefill_progress(1.5) == 50  # b started when a ended
    assert s.mark_prefill_completed("b", now=2.0)  # 100 tokens in 1 s (from 1.0), not 1.5 s
    assert s.prefill_rate == 100.0
    assert s.prefill_progress(5.0) == 0  # nothing pending


def test_a_request_still_prefilling_is_charged_once_so_the_holder_keeps_its_prefix():
    """The decision log's ``elsewhere`` case of the peers benchmark (docs/routing.md): worker 1 holds a
    conversation's 480-token history and is prefilling another, cold 462-token prompt; the next turn (520
    tokens) waits there behind 462 + 40 tokens, or computes all 520 on idle worker 2.  Counted as pending
    prefill *and* as decode blocks, the cold prompt made worker 1 the dearer (an extra 29 blocks) and the
    turn was computed again elsewhere: 7.6 s instead of about 1 s.  Charged once, worker 1 keeps it."""
    r = KvRouter(block_size=16, overlap_score_weight=2.0, seed=0, clock=lambda: 0.0)
    history = list(range(10_000, 10_480))
    publish_prefix(r, 1, history)
    r.add_request("cold", list(range(50_000, 50_462)), 1)
    turn = history + list(range(20_000, 20_040))
    assert r.select(turn, [1, 2]).worker_id == 1
    costs = {c.worker_id: c for c in r.last_costs}
    assert costs[1].prefill_tokens == 40 + 462 and costs[1].decode_blocks == 33
    # once the cold prompt decodes, its blocks are load, and its prefill is no longer ahead of the turn
    r.on_first_token("cold")
    r.select(turn, [1, 2])
    costs = {c.worker_id: c for c in r.last_costs}
    assert costs[1].prefill_tokens == 40 and costs[1].decode_blocks == 33 + 29

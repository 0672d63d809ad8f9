"""The KV block index in C (dynamo.kv.native.blockcore), against a plain-Python model of what it must answer.

The model keeps each worker's ``{block name: sequence hash}`` and scores a query by walking it worker by
worker: obviously right and slow.  The index is driven through its JSON entry point (what the frontend
and ``RadixTree.apply_event`` use) and its Python-object one, with random stores, evictions and workers
leaving; every answer and count is compared.  The sequence hash is checked against xxh3 itself.
"""

import random
import struct

import orjson
import pytest
import xxhash

from dynamo.kv.indexer import JSON_FALLBACK, JSON_PARENT_UNKNOWN
from dynamo.kv.native import BlockIndex, sequence_hash

MASK = (1 << 64) - 1


def xxh_pair(parent, local):
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)


def test_sequence_hash_is_xxh3_of_the_pair():
    rng = random.Random(5)
    pairs = [(0, 0), (MASK, MASK), (1, MASK), (MASK, 0)] + [(rng.getrandbits(64), rng.getrandbits(64))
                                                            for _ in range(20_000)]
    assert all(sequence_hash(p, q) == xxh_pair(p, q) for p, q in pairs)
    with pytest.raises(OverflowError):
        sequence_hash(-1, 0)
    with pytest.raises(OverflowError):
        sequence_hash(1 << 64, 0)


class Model:
    def __init__(self):
        self.lookup = {}

    def stored(self, w, parent, blocks):
        lk = self.lookup.get(w)
        if parent is not None:
            if lk is None or parent not in lk:
                return False
            p = lk[parent]
        else:
            p = None
        lk = self.lookup.setdefault(w, {})
        for name, local in blocks:
            p = local if p is None else xxh_pair(p, local)
            lk[name] = p
        return True

    def removed(self, w, names):
        lk = self.lookup.get(w)
        unknown = 0
        for n in names:
            if lk is None or n not in lk:
                unknown += 1
            else:
                del lk[n]
        if lk is not None and not lk:
            del self.lookup[w]
        return unknown

    def remove_worker(self, w):
        self.lookup.pop(w, None)

    def seqs(self, local):
        out, p = [], None
        for x in local:
            p = x if p is None else xxh_pair(p, x)
            out.append(p)
        return out

    def scores(self, local):
        seq = self.seqs(local)
        out = {}
        for w, lk in self.lookup.items():
            held = set(lk.values())
            n = 0
            while n < len(seq) and seq[n] in held:
                n += 1
            if n:
                out[w] = n
        return out

    def node_count(self):
        return len({s for lk in self.lookup.values() for s in lk.values()})


def bare_stored(parent, blocks, eid=1):
    return orjson.dumps({"event_id": eid, "data": {"stored": {
        "parent_hash": parent, "blocks": [{"block_hash": n, "tokens_hash": t} for n, t in blocks]}}})


def wrapped(worker, data, eid=1):
    return orjson.dumps({"worker_id": worker, "event": {"event_id": eid, "data": data}})


@pytest.mark.parametrize("entry", ["json-bare", "json-wrapped", "objects"])
def test_random_stores_evictions_and_workers_leaving_match_the_model(entry):
    rng = random.Random(11 if entry == "objects" else 12)
    ix, model = BlockIndex(), Model()
    # a few shared prefixes (local hashes); workers store them and histories under them
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    chains = {}  # worker -> list of chains of (name, local) it stored

    def name_of(w, seq):  # one name per content per worker (as engines that name blocks by hash)
        return (seq * 0x9E3779B97F4A7C15 + w) & MASK

    def store(w, parent, blocks):
        if entry == "json-bare":
            code = ix.apply_json(bare_stored(parent, blocks), w)
            got = {0: True, JSON_PARENT_UNKNOWN: False}[code]
        elif entry == "json-wrapped":
            code = ix.apply_json(wrapped(w, {"stored": {"parent_hash": parent, "blocks": [
                {"block_hash": n, "tokens_hash": t} for n, t in blocks]}}))
            got = {0: True, JSON_PARENT_UNKNOWN: False}[code]
        else:
            got = ix.apply_stored(w, parent, blocks)
        assert got == model.stored(w, parent, blocks)

    def remove(w, names):
        if entry == "objects":
            got = ix.apply_removed(w, names)
        else:
            raw = orjson.dumps({"event_id": 2, "data": {"removed": {"block_hashes": names}}})
            got = ix.apply_json(raw, w) if entry == "json-bare" else ix.apply_json(
                wrapped(w, {"removed": {"block_hashes": names}}))
        assert got == model.removed(w, names)

    workers = list(range(1, 25))
    for step in range(3000):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.5:
            pre = rng.choice(prefixes)
            seqs = model.seqs(pre)
            blocks = [(name_of(w, s), loc) for s, loc in zip(seqs, pre, strict=True)]
            store(w, None, blocks)
            tail = [rng.getrandbits(64) for _ in range(rng.randrange(1, 6))]
            tseqs = model.seqs(pre + tail)[len(pre):]
            tblocks = [(name_of(w, s), loc) for s, loc in zip(tseqs, tail, strict=True)]
            store(w, blocks[-1][0], tblocks)
            chains.setdefault(w, []).append(pre + tail)
        elif op < 0.8 and chains.get(w):
            local = rng.choice(chains[w])
            seqs = model.seqs(local)
            k = rng.randrange(1, len(seqs) + 1)
            names = [name_of(w, s) for s in seqs[-k:]][::-1]
            if rng.random() < 0.2:
                names.append(rng.getrandbits(64))  # one it never held
            remove(w, names)
        elif op < 0.85:
            store(w, rng.getrandbits(64), [(1, 2)])  # an unknown parent: nothing changes
        elif op < 0.9:
            ix.remove_worker(w)
            model.remove_worker(w)
            chains.pop(w, None)
        if step % 500 == 250:
            ix.compact()  # the sets laid out again (it happens by itself on big indexes)
        if step % 50 == 0:
            for _ in range(20):
                local = list(rng.choice(prefixes))
                if rng.random() < 0.5 and chains:
                    local = list(rng.choice(rng.choice([c for c in chains.values() if c] or [[local]])))
                local = local[: rng.randrange(1, len(local) + 1)] + [rng.getrandbits(64)] * rng.randrange(0, 3)
                want = model.scores(local)
                assert ix.find_matches(local) == want
                assert ix.find_matches(local, model.seqs(local)) == want
                assert ix.walk_local(local)[0] == want
            assert ix.node_count() == model.node_count()
            assert sorted(ix.workers()) == sorted(model.lookup)
            assert all(ix.num_blocks(w) == len(lk) for w, lk in model.lookup.items())


def test_names_zero_and_sequential_and_a_table_that_grows_and_shrinks():
    """Engines that name blocks 0, 1, 2... (slot ids) collide in a hash table's probe runs; deleting
    from the middle of a run must keep the rest findable."""
    ix, model = BlockIndex(), Model()
    n = 5000
    blocks = [(i, 1_000_000 + i) for i in range(n)]
    assert ix.apply_stored(7, None, blocks) and model.stored(7, None, blocks)
    rng = random.Random(3)
    gone = rng.sample(range(n), n // 2)
    assert ix.apply_removed(7, gone) == model.removed(7, gone) == 0
    assert ix.num_blocks(7) == n - n // 2
    assert ix.apply_stored(7, blocks[n - 1][0] if n - 1 not in gone else None, [(n + 5, 42)]) is True
    model.stored(7, blocks[n - 1][0] if n - 1 not in gone else None, [(n + 5, 42)])
    left = sorted(set(range(n)) - set(gone))
    assert ix.apply_removed(7, left + [n + 5]) == 0 and ix.workers() == [] and ix.node_count() == 0
    assert ix.find_matches([1_000_000]) == {}


def test_walk_counts_blocks_looked_at_and_stops_early_on_one_worker():
    ix = BlockIndex()
    local = [11, 12, 13, 14]
    seq = Model().seqs(local)
    ix.apply_stored(1, None, list(zip(seq, local, strict=True)))
    ix.apply_stored(2, None, list(zip(seq[:2], local[:2], strict=True)))
    assert ix.walk(seq) == ({1: 4, 2: 2}, 4)
    assert ix.walk_local(local + [99]) == ({1: 4, 2: 2}, 4)
    # worker 2 drops out at depth 2: the walk goes on with 1 alone unless early_exit
    assert ix.walk_local(local, early_exit=True) == ({2: 2, 1: 3}, 3)
    ix.remove_worker(1)
    assert ix.walk_local(local) == ({2: 2}, 2) and ix.holders(seq[0]) == [2] and ix.holders(seq[3]) == []


def test_an_index_that_outgrows_small_pages_keeps_every_block():
    # past 4 MiB (262,144 nodes) the node array moves to a mapping of its own, then grows by moving its pages
    rng = random.Random(3)
    ix, model = BlockIndex(), Model()
    chains = []
    for w in range(1, 4):
        local = [rng.getrandbits(64) for _ in range(200_000)]
        seqs = model.seqs(local)
        names = [rng.getrandbits(64) for _ in seqs]
        parent = None
        for i in range(0, len(seqs), 5_000):
            assert ix.apply_stored(w, parent, list(zip(names[i:i + 5_000], local[i:i + 5_000], strict=True)))
            parent = names[i + 4_999]
        chains.append(local)
    assert ix.node_count() == 600_000
    for w, local in enumerate(chains, start=1):
        assert ix.walk_local(local) == ({w: 200_000}, 200_000)
        assert ix.find_matches(local[:1_000] + [rng.getrandbits(64)]) == {w: 1_000}
    ix.remove_worker(2)
    assert ix.find_matches(chains[1][:10]) == {} and ix.find_matches(chains[2][:10]) == {3: 10}


def test_query_hashes_take_the_whole_u64_range_and_nothing_outside_it():
    ix = BlockIndex()
    local = [0, 1, (1 << 30) - 1, 1 << 30, (1 << 60) + 3, MASK]  # one, two and three 30-bit digits
    seq = Model().seqs(local)
    ix.apply_stored(7, None, list(zip(seq, local, strict=True)))
    assert ix.walk_local(local) == ({7: 6}, 6)
    assert ix.find_matches(local, seq) == {7: 6}
    for bad, error in [(-1, OverflowError), (1 << 64, OverflowError), (-(1 << 70), OverflowError),
                       (1.0, TypeError), (True, TypeError), ("1", TypeError)]:
        with pytest.raises(error):
            ix.walk_local(local[:2] + [bad])
        with pytest.raises(error):
            ix.find_matches([bad])


@pytest.mark.parametrize("raw", [
    b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": -1, "tokens_hash": 2}]}}}',
    b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1.5, "tokens_hash": 2}]}}}',
    b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 18446744073709551616, "tokens_hash": 2}]}}}',
    b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1}]}}}',
    b'{"event_id": 1, "dp_rank": 1, "data": {"stored": {"parent_hash": null, "blocks": []}}}',
    b'{"event_id": 1, "data": "cleared"}',
    b'{"data": {"removed": {"block_hashes": [1]}}}',
    b'{"event_id": 1, "data": {"removed": {"block_hashes": [1]}, "stored": {}}}',
    b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}',
    b'{"event_id": 1, "data": {"st\\u006fred": {"parent_hash": null, "blocks": []}}}',
    b'[1, 2]',
    b'not json',
])
def test_shapes_it_does_not_parse_are_handed_back_with_nothing_changed(raw):
    ix = BlockIndex()
    assert ix.apply_json(raw, 5) == JSON_FALLBACK
    assert ix.workers() == [] and ix.node_count() == 0


def test_wrapped_events_with_a_tier_or_a_medium_are_handed_back():
    ix = BlockIndex()
    data = {"stored": {"parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}
    for extra in ({"storage_tier": "host_pinned"}, {"worker_id": -3}):
        raw = orjson.dumps({"worker_id": 4, "event": {"event_id": 1, "data": data}} | extra)
        assert ix.apply_json(raw) == JSON_FALLBACK
    raw = orjson.dumps({"worker_id": 4, "event": {"event_id": 1, "data": data, "medium": "CPU"}})
    assert ix.apply_json(raw) == JSON_FALLBACK
    assert ix.node_count() == 0
    # spaces, keys in any order, unknown keys and a null tier are fine
    raw = b' { "event" : { "data" : { "stored" : { "blocks" : [ { "tokens_hash" : 2 , "x" : [true, "s"],' \
          b' "block_hash" : 1 } ] } } , "event_id" : 0 } , "storage_tier" : null , "worker_id" : 4 } '
    assert ix.apply_json(raw) == 0 and ix.find_matches([2]) == {4: 1}


def test_unknown_parent_and_unknown_removals_through_json():
    ix = BlockIndex()
    assert ix.apply_json(bare_stored(77, [(1, 2)]), 5) == JSON_PARENT_UNKNOWN
    assert ix.workers() == []
    assert ix.apply_json(bare_stored(None, [(1, 2), (3, 4)]), 5) == 0
    raw = orjson.dumps({"event_id": 2, "data": {"removed": {"block_hashes": [3, 9, 10]}}})
    assert ix.apply_json(raw, 5) == 2  # two it never held; block 3 is gone all the same
    assert ix.find_matches([2, 4]) == {5: 1}

"""The mocker's KV block manager: ref counts, the inactive LRU pool, eviction, promotion, events."""

from dynamo.engines.mocker.kv_manager import Block, KvManager


class Recorder:
    def __init__(self):
        self.events = []

    def stored(self, parent, blocks):
        self.events.append(("stored", parent, blocks))

    def removed(self, hashes):
        self.events.append(("removed", hashes))


def manager(n, rec=None):
    rec = rec or Recorder()
    return KvManager(n, on_stored=rec.stored, on_removed=rec.removed), rec


def chain(*ids):
    """Cacheable blocks id[i] with local hash id*10, parent = previous id."""
    out, prev = [], None
    for i in ids:
        out.append(Block(i, i * 10, prev))
        prev = i
    return out


def test_use_release_and_reuse():
    kv, rec = manager(8)
    assert kv.use(chain(1, 2, 3))
    assert rec.events == [("stored", None, [(1, 10), (2, 20), (3, 30)])]
    assert kv.num_active == 3 and kv.num_free == 5
    # a second sequence sharing the prefix: ref counts, one new block, one event for it only
    assert kv.use(chain(1, 2, 4))
    assert rec.events[-1] == ("stored", 2, [(4, 40)])
    assert kv.active == {1: 2, 2: 2, 3: 1, 4: 1}
    kv.release([3, 2, 1])
    assert kv.active == {1: 1, 2: 1, 4: 1} and list(kv.inactive) == [3]
    kv.release([4, 2, 1])
    assert kv.num_active == 0 and list(kv.inactive) == [3, 4, 2, 1]
    assert kv.cached_prefix([1, 2, 3]) == 3 and kv.cached_prefix([9, 1]) == 0
    # revival from the inactive pool publishes nothing
    n = len(rec.events)
    assert kv.use(chain(1, 2, 3))
    assert len(rec.events) == n and list(kv.inactive) == [4]


def test_private_blocks_are_freed_not_cached():
    kv, rec = manager(4)
    p = kv.private_id()
    assert p < 0 and kv.private_id() != p
    assert kv.use([Block(p)])
    assert rec.events == []
    kv.release([p])
    assert kv.num_active == 0 and kv.num_inactive == 0


def test_eviction_lru_and_events():
    kv, rec = manager(4)
    kv.use(chain(1, 2))
    kv.release([2, 1])  # tail first: 2 is the least recently released
    kv.use([Block(5, 50, None)])
    kv.release([5])
    assert list(kv.inactive) == [2, 1, 5]
    assert kv.use(chain(7, 8))  # needs 2 slots, 1 free: evicts 2
    assert rec.events[-2:] == [("removed", [2]), ("stored", None, [(7, 70), (8, 80)])]
    assert list(kv.inactive) == [1, 5]
    assert kv.evictions == 1


def test_use_is_all_or_nothing():
    kv, rec = manager(3)
    assert kv.use(chain(1, 2))
    assert not kv.use(chain(3, 4))  # 2 active + 2 new > 3, nothing evictable
    assert kv.active == {1: 1, 2: 1} and len(rec.events) == 1
    kv.release([2])  # 2 becomes inactive: now 1 + (revive nothing) + 2 new = 3 fits by evicting 2
    assert kv.use(chain(3, 4))
    assert ("removed", [2]) in rec.events


def test_revived_blocks_are_not_evicted_for_their_own_request():
    kv, rec = manager(3)
    kv.use(chain(1, 2))
    kv.release([2, 1])
    assert kv.use(chain(1, 2, 3))  # revive 1, 2 and add 3: exactly full, nothing evicted
    assert not any(e[0] == "removed" for e in rec.events)
    assert kv.num_active == 3


def test_promote_partial_block():
    kv, rec = manager(4)
    kv.use(chain(1))
    p = kv.private_id()
    kv.use([Block(p)])
    kv.promote(p, Block(2, 20, 1))
    assert kv.active == {1: 1, 2: 1}
    assert rec.events[-1] == ("stored", 1, [(2, 20)])
    # promoting into a block that is already cached shares it
    q = kv.private_id()
    kv.use([Block(q)])
    kv.promote(q, Block(2, 20, 1))
    assert kv.active == {1: 1, 2: 2}
    kv.release([2])
    kv.release([2])
    r = kv.private_id()
    kv.use([Block(r)])
    n = len(rec.events)
    kv.promote(r, Block(2, 20, 1))  # revived from inactive: no event
    assert len(rec.events) == n and kv.active == {1: 1, 2: 1}


def test_clear_inactive():
    kv, rec = manager(4)
    kv.use(chain(1, 2))
    kv.release([2, 1])
    assert kv.clear() == [2, 1]
    assert rec.events[-1] == ("removed", [2, 1])

"""The mocker's KV block manager: a fixed number of block slots, prefix caching, LRU eviction, events.

Blocks are named by integers:

* a *full, cacheable* block (prefix caching on) is named by its sequence hash (u64, >= 0), so the same
  prefix in two requests is the same block;
* every other block (a partial tail, or any block with prefix caching off) gets a private negative id
  from :meth:`KvManager.private_id`; it is never shared and never cached.

Each slot is in one of two states:

* **active**: referenced by at least one running sequence (ref-counted);
* **inactive**: a full cacheable block nobody references, kept for reuse in an LRU pool (least recently
  released first) and evicted only when a new block needs its slot.

``active + inactive <= num_blocks`` always.  Storing a new cacheable block publishes a ``stored`` event
(runs of consecutive new blocks share one event); evicting one publishes ``removed``.  A block revived
from the inactive pool publishes nothing: the router already knows it is cached.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Iterable, NamedTuple, Sequence

# (parent_hash, [(block_hash, tokens_hash), ...]) and [block_hash, ...]
StoredCallback = Callable[[int | None, list[tuple[int, int]]], None]
RemovedCallback = Callable[[list[int]], None]


class Block(NamedTuple):
    """A block to allocate: its id, and for cacheable full blocks its local hash and parent id."""

    id: int
    local_hash: int | None = None  # None: a private block (partial tail, or prefix caching off)
    parent: int | None = None  # the sequence hash of the previous full block, None at the start

    @property
    def cacheable(self) -> bool:
        return self.local_hash is not None


class KvManager:
    def __init__(self, num_blocks: int, *, on_stored: StoredCallback | None = None,
                 on_removed: RemovedCallback | None = None):
        self.num_blocks = num_blocks
        self.active: dict[int, int] = {}  # block id -> reference count
        self.inactive: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._ids = itertools.count(1)
        self.evictions = 0

    # -- state ---------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_inactive(self) -> int:
        return len(self.inactive)

    @property
    def num_free(self) -> int:
        """Slots holding nothing at all (inactive blocks are evictable but not free)."""
        return self.num_blocks - len(self.active) - len(self.inactive)

    def private_id(self) -> int:
        return -next(self._ids)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.active or block_id in self.inactive

    def cached_prefix(self, block_ids: Sequence[int]) -> int:
        """How many leading ``block_ids`` are held (active or inactive)."""
        n = 0
        for b in block_ids:
            if b not in self.active and b not in self.inactive:
                break
            n += 1
        return n

    def new_slots_needed(self, block_ids: Iterable[int]) -> int:
        """Slots that allocating ``block_ids`` would take beyond the active set (revivals included)."""
        return sum(1 for b in set(block_ids) if b not in self.active)

    # -- transitions ---------------------------------------------------------------------------
    def use(self, blocks: Sequence[Block]) -> bool:
        """Reference ``blocks`` (all or nothing).  False if even evicting every inactive block is not enough."""
        active, inactive = self.active, self.inactive
        revive = [b for b in blocks if b.id in inactive]
        new_ids = {b.id for b in blocks if b.id not in active and b.id not in inactive}
        # after reviving, the inactive pool shrinks; everything still inactive can be evicted
        if len(active) + len({b.id for b in revive}) + len(new_ids) > self.num_blocks:
            return False
        for b in revive:
            if b.id in inactive:
                del inactive[b.id]
                active[b.id] = 0
        overflow = len(active) + len(inactive) + len(new_ids) - self.num_blocks
        if overflow > 0:
            self._evict(overflow)
        run_parent: int | None = None
        run: list[tuple[int, int]] = []
        last_new: int | None = None
        for b in blocks:
            if b.id in active:
                active[b.id] += 1
                continue
            active[b.id] = 1
            if not b.cacheable:
                continue
            if run and b.parent == last_new:
                run.append((b.id, b.local_hash))  # type: ignore[arg-type]
            else:
                self._flush_stored(run_parent, run)
                run_parent, run = b.parent, [(b.id, b.local_hash)]  # type: ignore[list-item]
            last_new = b.id
        self._flush_stored(run_parent, run)
        return True

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block.  Unreferenced cacheable blocks join the inactive pool (most
        recently released last); private blocks are freed.  Pass a sequence's blocks tail first, so its
        tail is evicted before its head."""
        active, inactive = self.active, self.inactive
        for bid in block_ids:
            n = active.get(bid)
            if n is None:
                continue
            if n > 1:
                active[bid] = n - 1
                continue
            del active[bid]
            if bid >= 0:
                inactive[bid] = None

    def promote(self, private_id: int, block: Block) -> None:
        """A sequence's partial block became full: it is now ``block`` (never needs a new slot)."""
        n = self.active.get(private_id, 0)
        if n <= 1:
            self.active.pop(private_id, None)
        else:  # pragma: no cover - private blocks have one owner
            self.active[private_id] = n - 1
        if block.id in self.active:
            self.active[block.id] += 1
        elif block.id in self.inactive:
            del self.inactive[block.id]
            self.active[block.id] = 1
        else:
            self.active[block.id] = 1
            if block.cacheable:
                self._flush_stored(block.parent, [(block.id, block.local_hash)])  # type: ignore[list-item]

    def clear(self) -> list[int]:
        """Forget every inactive block (e.g. on reset); returns their ids."""
        gone = list(self.inactive)
        self.inactive.clear()
        if gone and self.on_removed is not None:
            self.on_removed(gone)
        return gone

    # -- internals -----------------------------------------------------------------------------
    def _evict(self, count: int) -> None:
        gone = []
        for _ in range(count):
            bid, _ = self.inactive.popitem(last=False)
            gone.append(bid)
        self.evictions += len(gone)
        if gone and self.on_removed is not None:
            self.on_removed(gone)

    def _flush_stored(self, parent: int | None, run: list[tuple[int, int]]) -> None:
        if run and self.on_stored is not None:
            self.on_stored(parent, list(run))

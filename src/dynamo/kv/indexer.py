"""Which worker holds which prefix: an index of KV blocks fed by the workers' KV events.

A block is known by its **sequence hash** (hashing.py), which names the block *and its whole prefix*, so
a flat map ``sequence hash -> workers holding it`` answers the same questions as a radix tree of local
hashes (a path from the root spells a prefix; so does a chain of sequence hashes): one table lookup per
block.  The indexer computes the sequence hash of each stored block itself, from its parent's and the
block's ``tokens_hash`` (local hash), whatever the engine calls the block; each worker has a lookup from
its own external block names (``block_hash`` in events) to sequence hashes, so ``removed`` events and
``parent_hash`` references can be resolved.

That map is :class:`BlockIndex`, in C (dynamo/kv/native/blockcore.c says why, with the measurement): there is no
pure-Python twin, so the router, the frontend and ``RadixTree`` (api.py) all run the one implementation
the tests check.  It takes the engines' JSON events as bytes (``apply_json``) and hands anything it does
not parse back to :func:`dynamo.kv.events.parse_kv_event`, which decodes it or says what is wrong.

Differences from the original, on purpose:

* ``find_matches`` counts the *contiguous* prefix a worker holds: a worker that lost block 2 but still
  has block 3 scores 2 blocks, not 3 (an engine can only reuse a prefix without holes).  Blocks are
  walked (and a query's sequence hashes computed) only while some worker still matches.
* An engine that evicted a parent block before its children, and stores the parent again, has its
  children count again at once: they are keyed by content, not by a place in a tree.

Lower tiers.  Blocks a worker offloaded to host memory or disk (events with a ``storage_tier``,
protocols.py) go to one more index per tier, never into the device index: ``find_matches`` stays the
resident prefix, and :meth:`KvIndexer.find_lower_matches` says, per tier, how far a worker's prefix
reaches when that tier's blocks (and the nearer tiers') are counted too.  The router prices the
difference (docs/routing.md, "Offloaded blocks").

``ApproxKvIndexer`` (``--use-kv-events false``) has no events: after each routing decision it assumes
the request's blocks are cached on the chosen worker for a TTL (120 s), refreshed by each decision that
reuses them, and expired lazily on the next call (or by an explicit :meth:`ApproxKvIndexer.expire`).
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Annotated, Any, Callable, Sequence

import msgspec

from dynamo.kv.events import DEVICE, LOWER_TIERS, EventError, KvEvent, parse_kv_event
from dynamo.kv.native import BlockIndex

log = logging.getLogger(__name__)

WorkerId = int
# worker -> how many leading blocks of the query it holds (only workers with > 0)
Overlaps = dict[WorkerId, int]

# what BlockIndex.apply_json answers besides 0 (applied) and a count of unknown removed blocks
JSON_FALLBACK = -1  # not a shape it parses: decode it in Python
JSON_PARENT_UNKNOWN = -2  # stored blocks under a parent the worker is not known to hold: skipped


class KvIndexer:
    """The event-driven indexer: apply the workers' KV events, answer overlap queries."""

    def __init__(self) -> None:
        self.tree = BlockIndex()  # the device tier: blocks in the engines' own KV caches
        self.lower: dict[str, BlockIndex] = {}  # host_pinned, disk: restorable blocks, made on first use
        self.events_applied = 0
        self.events_rejected = 0

    def block_count(self) -> int:
        """Distinct blocks known in every tier (what the workers hold: it shrinks with their evictions)."""
        return self.tree.node_count() + sum(t.node_count() for t in self.lower.values())

    def memory_bytes(self) -> int:
        """Bytes of the index's tables, every tier (they keep their size once grown: freed slots are reused)."""
        return self.tree.memory_bytes() + sum(t.memory_bytes() for t in self.lower.values())

    def tier_tree(self, tier: str) -> BlockIndex:
        if tier == DEVICE:
            return self.tree
        tree = self.lower.get(tier)
        if tree is None:
            tree = self.lower[tier] = BlockIndex()
        return tree

    def apply_event(self, event: KvEvent | bytes | str | dict[str, Any]) -> bool:
        """Apply one wrapped KV event (parsed or raw JSON).  Bad events are logged and skipped (False).

        JSON (what the event plane delivers) of a device-tier ``stored`` or ``removed`` event is parsed
        and applied in C in one call (BlockIndex.apply_json); other tiers and ``cleared`` are decoded into
        typed structs by msgspec; anything that fits neither shape exactly (signed hashes, other
        spellings, errors) goes through :func:`parse_kv_event`, which says what is wrong."""
        if isinstance(event, (bytes, str)):
            code = self.tree.apply_json(event)
            if code == 0:
                self.events_applied += 1
                return True
            if code != JSON_FALLBACK:
                return self._count_json(code, event)
        if isinstance(event, (bytes, bytearray, memoryview, str)):
            try:
                wire = _decode_wire(event)
            except (msgspec.ValidationError, msgspec.DecodeError):
                wire = None
            if wire is not None and wire.event.medium is None and (wire.storage_tier is None
                                                                  or wire.storage_tier in LOWER_TIERS):
                data = wire.event.data
                tree = self.tree if wire.storage_tier is None else self.tier_tree(wire.storage_tier)
                if isinstance(data, str):
                    if data == "cleared":
                        if wire.storage_tier is None:
                            self.remove_worker(wire.worker_id)
                        else:
                            tree.remove_worker(wire.worker_id)
                        self.events_applied += 1
                        return True
                elif data.stored is not None and data.removed is None:
                    try:
                        ok = tree.apply_stored(wire.worker_id, data.stored.parent_hash, data.stored.blocks)
                    except OverflowError:  # a hash beyond u64 (msgspec checks only the lower bound)
                        log.warning("undecodable KV event skipped: a block hash does not fit in 64 bits")
                        self.events_rejected += 1
                        return False
                    if not ok:
                        _warn_parent(wire.worker_id, data.stored.parent_hash)
                    return self._count(ok)
                elif data.removed is not None and data.stored is None:
                    _warn_removed(wire.worker_id, tree.apply_removed(wire.worker_id, data.removed.block_hashes))
                    self.events_applied += 1
                    return True
        if not isinstance(event, KvEvent):
            try:
                event = parse_kv_event(event)
            except EventError as e:
                self.events_rejected += 1
                log.warning("undecodable KV event skipped: %s", e)
                return False
        ok = True
        tree = self.tier_tree(event.tier or DEVICE)
        if event.kind == "stored":
            ok = tree.apply_stored(event.worker_id, event.parent_hash, event.blocks)
            if not ok:
                _warn_parent(event.worker_id, event.parent_hash)
        elif event.kind == "removed":
            _warn_removed(event.worker_id, tree.apply_removed(event.worker_id, event.block_hashes))
        elif event.tier is None:
            self.remove_worker(event.worker_id)
        else:
            tree.remove_worker(event.worker_id)
        return self._count(ok)

    def _count_json(self, code: int, raw: bytes | str) -> bool:
        """Count (and log) what the C parser found wrong with a device-tier event it applied or skipped."""
        wire = _decode_wire(raw)  # it parsed in C, so it fits the wire shape: the details for the log
        data = wire.event.data
        assert not isinstance(data, str)
        if code == JSON_PARENT_UNKNOWN:
            assert data.stored is not None
            _warn_parent(wire.worker_id, data.stored.parent_hash)
            self.events_rejected += 1
            return False
        _warn_removed(wire.worker_id, code)
        self.events_applied += 1
        return True

    def _count(self, ok: bool) -> bool:
        if ok:
            self.events_applied += 1
        else:
            self.events_rejected += 1
        return ok

    def find_matches(self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None) -> Overlaps:
        return self.tree.find_matches(local_hashes, seq_hashes)

    def find_lower_matches(self, seq_hashes: Sequence[int]) -> dict[str, Overlaps]:
        """Per lower tier (nearest first), each worker's contiguous prefix of ``seq_hashes`` counting the
        blocks it holds on the device *or* in that tier or a nearer one (only workers with > 0).  Empty
        when no worker announced offloaded blocks: then nothing here costs anything."""
        levels = [self.tree]
        out: dict[str, Overlaps] = {}
        for tier in LOWER_TIERS:
            tree = self.lower.get(tier)
            if tree is None or not tree.node_count():
                continue
            levels.append(tree)
            out[tier] = _union_prefix(levels, seq_hashes)
        return out

    def find_tier_matches(self, tier: str, seq_hashes: Sequence[int]) -> Overlaps:
        """Each worker's contiguous prefix of ``seq_hashes`` in one lower tier alone, the device not
        counted (what a worker can hand over from there without its engine)."""
        tree = self.lower.get(tier)
        return tree.find_matches([], seq_hashes) if tree is not None and tree.node_count() else {}

    def remove_worker(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
        for tree in self.lower.values():
            tree.remove_worker(worker)


def _warn_parent(worker: WorkerId, parent_hash: int | None) -> None:
    log.warning("KV event from worker %x: stored blocks under unknown parent %s; skipped", worker, parent_hash)


def _warn_removed(worker: WorkerId, unknown: int) -> None:
    if unknown:
        log.warning("KV event from worker %x: %d removed block(s) were not known; ignored", worker, unknown)


def _union_prefix(trees: Sequence[BlockIndex], seq_hashes: Sequence[int]) -> Overlaps:
    """Each worker's contiguous prefix of blocks held in any of ``trees``: a few sets per block, for the
    rare query that has offloaded blocks to consider (workers are few next to blocks)."""
    scores: Overlaps = {}
    active: set[WorkerId] = set()
    for depth, s in enumerate(seq_hashes):
        held: set[WorkerId] = set()
        for tree in trees:
            held.update(tree.holders(s))
        if depth == 0:
            active = held
        else:
            for w in active - held:
                scores[w] = depth
            active &= held
        if not active:
            return scores
    for w in active:
        scores[w] = len(seq_hashes)
    return scores


# The wire shape of a KV event (protocols.py), for msgspec's typed JSON decoding.  Hashes must be u64 here;
# the rare producer that sends signed i64 falls back to parse_kv_event, which reads their bits.
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec itself refuses what is beyond u64


class _WireBlock(msgspec.Struct, gc=False):
    block_hash: _U64
    tokens_hash: _U64


class _WireStored(msgspec.Struct, gc=False):
    blocks: list[_WireBlock]
    parent_hash: _U64 | None = None


class _WireRemoved(msgspec.Struct, gc=False):
    block_hashes: list[_U64]


class _WireData(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    stored: _WireStored | None = None
    removed: _WireRemoved | None = None


class _WireEvent(msgspec.Struct, gc=False):
    data: _WireData | str
    event_id: _U64 = 0
    medium: str | None = None  # vLLM's spelling of the tier: parsed by parse_kv_event


class _WireKvEvent(msgspec.Struct, gc=False):
    worker_id: int
    event: _WireEvent
    storage_tier: str | None = None  # only our canonical names take the fast path; others are parsed


_decode_wire = msgspec.json.Decoder(_WireKvEvent).decode


DEFAULT_APPROX_TTL_S = 120.0


class ApproxKvIndexer:
    """No events: a routed request's blocks are assumed cached on the chosen worker for ``ttl`` seconds."""

    def __init__(self, ttl: float = DEFAULT_APPROX_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.tree = BlockIndex()
        self.ttl = ttl
        self.clock = clock
        self._expiry: dict[tuple[WorkerId, int], float] = {}
        self._heap: list[tuple[float, WorkerId, int]] = []

    def block_count(self) -> int:
        """Blocks assumed cached now (each expires ``ttl`` after its last decision)."""
        return len(self._expiry)

    def memory_bytes(self) -> int:
        return self.tree.memory_bytes()

    def process_routing_decision(self, worker: WorkerId, local_hashes: Sequence[int],
                                 seq_hashes: Sequence[int]) -> None:
        """Record that ``worker`` now holds these blocks (a chain from the root), until the TTL runs out."""
        if not local_hashes:
            return
        now = self.clock()
        self.expire(now)
        deadline = now + self.ttl
        self.tree.apply_own_chain(worker, seq_hashes)
        for s in seq_hashes:
            self._expiry[(worker, s)] = deadline
            heapq.heappush(self._heap, (deadline, worker, s))
        # keep the heap from growing without bound when the same blocks are refreshed again and again
        if len(self._heap) > 4 * len(self._expiry) + 1024:
            self._heap = [(d, w, s) for (w, s), d in self._expiry.items()]
            heapq.heapify(self._heap)

    def expire(self, now: float | None = None) -> int:
        """Drop blocks whose TTL has passed; returns how many were dropped."""
        if now is None:
            now = self.clock()
        dropped = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, worker, s = heapq.heappop(heap)
            if self._expiry.get((worker, s)) != deadline:
                continue  # refreshed since, or the worker is gone
            del self._expiry[(worker, s)]
            self.tree.apply_removed(worker, (s,))
            dropped += 1
        return dropped

    def find_matches(self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None) -> Overlaps:
        self.expire()
        return self.tree.find_matches(local_hashes, seq_hashes)

    def remove_worker(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
        for key in [k for k in self._expiry if k[0] == worker]:
            del self._expiry[key]

    def next_expiry(self) -> float | None:
        """When the next block may expire (for callers that prefer a timer to lazy expiry)."""
        return self._heap[0][0] if self._heap else None

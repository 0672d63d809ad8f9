"""Which worker holds which prefix: an index of KV blocks fed by the workers' KV events.

A block is known by its **sequence hash** (hashing.py), which names the block *and its whole prefix*, so
a flat map ``sequence hash -> workers holding it`` answers the same questions as a radix tree of local
hashes (a path from the root spells a prefix; so does a chain of sequence hashes), at a fraction of the
cost in Python: no node objects, one dict lookup per block.  The indexer computes the sequence hash of
each stored block itself, from its parent's and the block's ``tokens_hash`` (local hash), whatever the
engine calls the block; each worker has a lookup from its own external block names (``block_hash`` in
events) to sequence hashes, so ``removed`` events and ``parent_hash`` references can be resolved.

The workers holding a block are a bitmask (an int, one bit per worker): walking a prompt's blocks is an
AND per block whatever the number of workers, which keeps a decision fast with a prefix cached on
hundreds of workers.  Bits are given out as workers appear and reused after a worker is removed.  Most
blocks have one holder (a conversation's history lives where it ran): those store ``~index`` (a
negative int) instead of a mask, which for worker 900 would be a 900-bit int per block.

Differences from the original, on purpose:

* ``find_matches`` counts the *contiguous* prefix a worker holds: a worker that lost block 2 but still
  has block 3 scores 2 blocks, not 3 (an engine can only reuse a prefix without holes).  Blocks are
  walked only while some worker still matches.
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
import struct
import time
from typing import Annotated, Any, Callable, Iterable, Sequence

import msgspec
import xxhash

from dynamo.kv.events import DEVICE, LOWER_TIERS, EventError, KvEvent, parse_kv_event
from dynamo.kv.hashing import KV_HASH_SEED, compute_seq_hashes

log = logging.getLogger(__name__)

WorkerId = int
# worker -> how many leading blocks of the query it holds (only workers with > 0)
Overlaps = dict[WorkerId, int]

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack


class BlockIndex:
    """The block index and per-worker lookups.  Single-threaded: call it from one event loop.

    It answers what a radix tree of local hashes would (a chain of sequence hashes *is* a path from the
    root), so Dynamo's Python ``RadixTree`` (dynamo/kv/api.py) is a thin layer over it.
    """

    def __init__(self) -> None:
        # sequence hash -> the workers holding it: a bitmask (>= 0), or ~index of the only one (< 0)
        self._holders: dict[int, int] = {}
        self._lookup: dict[WorkerId, dict[int, int]] = {}  # worker -> its block name -> sequence hash
        self._bit: dict[WorkerId, int] = {}  # worker -> its bit (1 << index)
        self._by_index: list[WorkerId | None] = []
        self._free: list[int] = []  # indices of removed workers, for reuse

    # -- workers and their bits ----------------------------------------------------------------
    def _bit_of(self, worker: WorkerId) -> int:
        bit = self._bit.get(worker)
        if bit is None:
            if self._free:
                i = self._free.pop()
                self._by_index[i] = worker
            else:
                i = len(self._by_index)
                self._by_index.append(worker)
            bit = self._bit[worker] = 1 << i
        return bit

    def _forget(self, worker: WorkerId) -> None:
        bit = self._bit.pop(worker, None)
        if bit is not None:
            i = bit.bit_length() - 1
            self._by_index[i] = None
            self._free.append(i)

    def _workers_in(self, mask: int) -> list[WorkerId]:
        out = []
        by_index = self._by_index
        while mask:
            low = mask & -mask
            w = by_index[low.bit_length() - 1]
            if w is not None:  # never expected: a bit is given back only once its worker holds nothing
                out.append(w)
            mask ^= low
        return out

    # -- events --------------------------------------------------------------------------------
    def apply_stored(self, worker: WorkerId, parent_hash: int | None, blocks: Iterable[Any]) -> bool:
        """Add ``blocks`` (a chain, the first one a child of ``parent_hash``) for ``worker``.  A block is
        anything with ``block_hash`` and ``tokens_hash`` attributes (a :class:`StoredBlock`, a decoded
        wire struct).

        Returns False (and logs a warning) when ``parent_hash`` is not a block the worker is known to hold.
        """
        lookup = self._lookup.get(worker)
        if parent_hash is None:
            parent = None
        else:
            parent = lookup.get(parent_hash) if lookup is not None else None
            if parent is None:
                log.warning("KV event from worker %x: stored blocks under unknown parent %d; skipped",
                            worker, parent_hash)
                return False
        if lookup is None:
            lookup = self._lookup[worker] = {}
        bit = self._bit_of(worker)
        solo = ~(bit.bit_length() - 1)
        holders = self._holders
        get = holders.get
        h, pack, seed = _xxh3, _pack_pair, KV_HASH_SEED
        for block in blocks:
            name = block.block_hash
            local = block.tokens_hash
            seq = local if parent is None else h(pack(parent, local), seed)
            old = lookup.get(name)
            if old != seq:
                if old is not None:  # the engine re-used a name for other content: forget the old one
                    self._clear(old, bit)
                # the same int object for both when the engine names blocks by sequence hash (less memory)
                lookup[name] = name if name == seq else seq
            v = get(seq)
            if v is None:
                holders[seq] = solo
            elif v < 0:
                if v != solo:
                    holders[seq] = (1 << ~v) | bit
            else:
                holders[seq] = v | bit
            parent = seq
        return True

    def apply_own_chain(self, worker: WorkerId, seq_hashes: Sequence[int]) -> None:
        """``worker`` holds these blocks, a chain from the root named by their sequence hashes (what the
        approximate indexer records for its own decisions)."""
        if not seq_hashes:
            return
        lookup = self._lookup.get(worker)
        if lookup is None:
            lookup = self._lookup[worker] = {}
        bit = self._bit_of(worker)
        solo = ~(bit.bit_length() - 1)
        holders = self._holders
        get = holders.get
        for seq in seq_hashes:
            lookup[seq] = seq
            v = get(seq)
            if v is None:
                holders[seq] = solo
            elif v < 0:
                if v != solo:
                    holders[seq] = (1 << ~v) | bit
            else:
                holders[seq] = v | bit

    def apply_removed(self, worker: WorkerId, block_hashes: Iterable[int]) -> int:
        """Forget these blocks of ``worker`` (by its names for them); returns how many it was not known to
        hold (logged and skipped: the others are still removed)."""
        lookup = self._lookup.get(worker)
        unknown = 0
        bit = self._bit.get(worker, 0)
        for name in block_hashes:
            seq = lookup.pop(name, None) if lookup is not None else None
            if seq is None:
                unknown += 1
                continue
            self._clear(seq, bit)
        if unknown:
            log.warning("KV event from worker %x: %d removed block(s) were not known; ignored", worker, unknown)
        if lookup is not None and not lookup:
            del self._lookup[worker]
            self._forget(worker)
        return unknown

    def _clear(self, seq: int, bit: int) -> None:
        holders = self._holders
        v = holders.get(seq)
        if v is None:
            return
        if v < 0:
            if 1 << ~v == bit:
                del holders[seq]
            return
        mask = v & ~bit
        if mask & (mask - 1):
            holders[seq] = mask  # still two or more
        elif mask:
            holders[seq] = ~(mask.bit_length() - 1)
        else:
            del holders[seq]

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget everything ``worker`` holds (it left, or sent ``cleared``)."""
        lookup = self._lookup.pop(worker, None)
        if lookup:
            bit = self._bit[worker]
            for seq in lookup.values():
                self._clear(seq, bit)
        self._forget(worker)

    clear_worker = remove_worker

    # -- queries -------------------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None) -> Overlaps:
        """For each worker, how many leading blocks of ``local_hashes`` it holds (only workers with > 0).

        ``seq_hashes`` (the prompt's sequence hashes, when the caller has them) saves hashing again."""
        if seq_hashes is None:
            seq_hashes = compute_seq_hashes(local_hashes)
        return self.walk(seq_hashes)[0]

    def walk(self, seq_hashes: Sequence[int], early_exit: bool = False) -> tuple[Overlaps, int]:
        """(each worker's contiguous prefix of ``seq_hashes``, how many blocks were looked at).

        The walk stops at the first block nobody holds, or once no worker's prefix reaches further.
        ``early_exit`` also stops it as soon as a single worker is left (Dynamo's ``find_matches``
        option: the caller only wants to know *who*, so that worker is credited the depth reached so
        far, not its whole prefix).  The count of blocks looked at is what Dynamo's access frequencies
        are kept for."""
        get = self._holders.get
        scores: Overlaps = {}
        active = 0
        depth = 0
        for s in seq_hashes:
            mask = get(s)
            if mask is None:
                break
            if mask < 0:
                mask = 1 << ~mask
            if depth:
                still = active & mask
                if still != active:  # these workers' prefixes end here
                    for w in self._workers_in(active ^ still):
                        scores[w] = depth
                    active = still
                    if not active:
                        return scores, depth + 1
            else:
                active = mask
            depth += 1
            if early_exit and not active & (active - 1):
                break
        if active:
            for w in self._workers_in(active):
                scores[w] = depth
        return scores, depth

    def holders(self, seq_hash: int) -> list[WorkerId]:
        """The workers holding the block named ``seq_hash``."""
        mask = self._holders.get(seq_hash)
        if mask is None:
            return []
        return self._workers_in(1 << ~mask if mask < 0 else mask)

    def workers(self) -> list[WorkerId]:
        return list(self._lookup)

    def num_blocks(self, worker: WorkerId) -> int:
        return len(self._lookup.get(worker, ()))

    def node_count(self) -> int:
        """Distinct blocks held by at least one worker."""
        return len(self._holders)


class KvIndexer:
    """The event-driven indexer: apply the workers' KV events, answer overlap queries."""

    def __init__(self) -> None:
        self.tree = BlockIndex()  # the device tier: blocks in the engines' own KV caches
        self.lower: dict[str, BlockIndex] = {}  # host_pinned, disk: restorable blocks, made on first use
        self.events_applied = 0
        self.events_rejected = 0

    def tier_tree(self, tier: str) -> BlockIndex:
        if tier == DEVICE:
            return self.tree
        tree = self.lower.get(tier)
        if tree is None:
            tree = self.lower[tier] = BlockIndex()
        return tree

    def apply_event(self, event: KvEvent | bytes | str | dict[str, Any]) -> bool:
        """Apply one wrapped KV event (parsed or raw JSON).  Bad events are logged and skipped (False).

        JSON (what NATS delivers) is decoded straight into typed structs by msgspec, several times faster
        than building dicts and checking them; anything that does not fit that shape exactly (signed
        hashes, other spellings, errors) goes through :func:`parse_kv_event`, which says what is wrong."""
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
                    except struct.error:  # a hash beyond u64 (msgspec checks only the lower bound)
                        log.warning("undecodable KV event skipped: a block hash does not fit in 64 bits")
                        ok = False
                    return self._count(ok)
                elif data.removed is not None and data.stored is None:
                    tree.apply_removed(wire.worker_id, data.removed.block_hashes)
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
        elif event.kind == "removed":
            tree.apply_removed(event.worker_id, event.block_hashes)
        elif event.tier is None:
            self.remove_worker(event.worker_id)
        else:
            tree.remove_worker(event.worker_id)
        return self._count(ok)

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

    def remove_worker(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
        for tree in self.lower.values():
            tree.remove_worker(worker)


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

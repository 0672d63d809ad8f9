"""Which worker holds which prefix: a radix tree of KV blocks fed by the workers' KV events (spec 7.9).

A node stands for one block *in its prefix*: the path from the root spells the local block hashes of a
prefix, and a node's ``workers`` are the workers that hold that block's KV.  Each worker also has a
lookup from its own external block names (``block_hash`` in events) to nodes, so ``removed`` events and
``parent_hash`` references can be resolved.

Differences from the original, on purpose:

* ``find_matches`` counts the *contiguous* prefix a worker holds: a worker that lost block 2 but still
  has block 3 scores 2 blocks, not 3 (an engine can only reuse a prefix without holes).  Nodes are
  walked only while some worker still matches.
* A node that loses its last worker is pruned only once it has no children either (and then its
  ancestors, if they are in the same state).  A node that is empty but still has populated children is
  kept, so an engine that evicted a parent block before its children and stores it again reconnects the
  subtree instead of orphaning it.  No lookup entry ever points at a detached node.

``ApproxKvIndexer`` (``--use-kv-events false``) has no events: after each routing decision it assumes
the request's blocks are cached on the chosen worker for a TTL (120 s), refreshed by each decision that
reuses them, and expired lazily on the next call (or by an explicit :meth:`ApproxKvIndexer.expire`).
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any, Callable, Iterable, Sequence

from dynamo.llm.kv_router.protocols import EventError, KvEvent, StoredBlock, parse_kv_event

log = logging.getLogger(__name__)

WorkerId = int
OverlapScores = dict[WorkerId, int]


class _Node:
    __slots__ = ("key", "parent", "children", "workers")

    def __init__(self, key: int | None, parent: "_Node | None"):
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.workers: set[WorkerId] = set()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"_Node(key={self.key}, workers={sorted(self.workers)}, children={len(self.children)})"


class RadixTree:
    """The tree and per-worker lookups.  Single-threaded: call it from one event loop."""

    def __init__(self) -> None:
        self.root = _Node(None, None)
        self._lookup: dict[WorkerId, dict[int, _Node]] = {}

    # -- events --------------------------------------------------------------------------------
    def apply_stored(self, worker: WorkerId, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> bool:
        """Add ``blocks`` (a chain, the first one a child of ``parent_hash``) for ``worker``.

        Returns False (and logs a warning) when ``parent_hash`` is not a block the worker is known to hold.
        """
        lookup = self._lookup.setdefault(worker, {})
        if parent_hash is None:
            node = self.root
        else:
            found = lookup.get(parent_hash)
            if found is None:
                log.warning("KV event from worker %x: stored blocks under unknown parent %d; skipped",
                            worker, parent_hash)
                if not lookup:
                    del self._lookup[worker]
                return False
            node = found
        for block in blocks:
            child = lookup.get(block.block_hash)
            if child is None or child.parent is not node:
                if child is not None:
                    # the engine re-used a name under another parent: forget the old placement
                    self._drop(worker, child)
                child = node.children.get(block.tokens_hash)
                if child is None:
                    child = _Node(block.tokens_hash, node)
                    node.children[block.tokens_hash] = child
                lookup[block.block_hash] = child
            child.workers.add(worker)
            node = child
        return True

    def apply_removed(self, worker: WorkerId, block_hashes: Iterable[int]) -> None:
        lookup = self._lookup.get(worker)
        unknown = 0
        for h in block_hashes:
            node = lookup.pop(h, None) if lookup is not None else None
            if node is None:
                unknown += 1
                continue
            self._drop(worker, node)
        if unknown:
            log.warning("KV event from worker %x: %d removed block(s) were not known; ignored", worker, unknown)
        if lookup is not None and not lookup:
            del self._lookup[worker]

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget everything ``worker`` holds (it left, or sent ``cleared``)."""
        lookup = self._lookup.pop(worker, None)
        if not lookup:
            return
        for node in lookup.values():
            self._drop(worker, node)

    clear_worker = remove_worker

    def _drop(self, worker: WorkerId, node: _Node) -> None:
        node.workers.discard(worker)
        # prune upwards while nodes hold nothing and lead nowhere
        while node.parent is not None and not node.workers and not node.children:
            parent = node.parent
            if parent.children.get(node.key) is node:  # type: ignore[arg-type]
                del parent.children[node.key]  # type: ignore[arg-type]
            node.parent = None
            node = parent

    # -- queries -------------------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int]) -> OverlapScores:
        """For each worker, how many leading blocks of ``local_hashes`` it holds (only workers with > 0)."""
        scores: OverlapScores = {}
        node = self.root
        active: set[WorkerId] = set()
        depth = 0
        for h in local_hashes:
            child = node.children.get(h)
            if child is None:
                break
            workers = child.workers
            if depth == 0:
                active = set(workers)
            elif not active <= workers:
                for w in active - workers:  # these workers' prefixes end here
                    scores[w] = depth
                active &= workers
            if not active:
                break
            depth += 1
            node = child
        for w in active:
            scores[w] = depth
        return scores

    def workers(self) -> list[WorkerId]:
        return list(self._lookup)

    def num_blocks(self, worker: WorkerId) -> int:
        return len(self._lookup.get(worker, ()))

    def node_count(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n - 1


class KvIndexer:
    """The event-driven indexer: apply the workers' KV events, answer overlap queries."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self.events_applied = 0
        self.events_rejected = 0

    def apply_event(self, event: KvEvent | bytes | str | dict[str, Any]) -> bool:
        """Apply one wrapped KV event (parsed or raw JSON).  Bad events are logged and skipped (False)."""
        if not isinstance(event, KvEvent):
            try:
                event = parse_kv_event(event)
            except EventError as e:
                self.events_rejected += 1
                log.warning("undecodable KV event skipped: %s", e)
                return False
        ok = True
        if event.kind == "stored":
            ok = self.tree.apply_stored(event.worker_id, event.parent_hash, event.blocks)
        elif event.kind == "removed":
            self.tree.apply_removed(event.worker_id, event.block_hashes)
        else:
            self.tree.remove_worker(event.worker_id)
        if ok:
            self.events_applied += 1
        else:
            self.events_rejected += 1
        return ok

    def find_matches(self, local_hashes: Sequence[int]) -> OverlapScores:
        return self.tree.find_matches(local_hashes)

    def remove_worker(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)


DEFAULT_APPROX_TTL_S = 120.0


class ApproxKvIndexer:
    """No events: a routed request's blocks are assumed cached on the chosen worker for ``ttl`` seconds."""

    def __init__(self, ttl: float = DEFAULT_APPROX_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.tree = RadixTree()
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
        self.tree.apply_stored(worker, None, [StoredBlock(s, l) for l, s in zip(local_hashes, seq_hashes)])
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

    def find_matches(self, local_hashes: Sequence[int]) -> OverlapScores:
        self.expire()
        return self.tree.find_matches(local_hashes)

    def remove_worker(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
        for key in [k for k in self._expiry if k[0] == worker]:
            del self._expiry[key]

    def next_expiry(self) -> float | None:
        """When the next block may expire (for callers that prefer a timer to lazy expiry)."""
        return self._heap[0][0] if self._heap else None

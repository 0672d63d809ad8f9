"""KV-aware routing: block hashing, the block indexer, the approximate indexer, the cost-based
scheduler and :class:`KvRouter`, which ties them together.  See docs/routing.md."""

from dynamo.frontend.kv_router.indexer import ApproxKvIndexer, KvIndexer, RadixTree
from dynamo.frontend.kv_router.router import KvRouter, RoutingDecision
from dynamo.frontend.kv_router.scheduler import ActiveSequences
from dynamo.llm.kv_events.hashing import (
    KV_HASH_SEED,
    block_hash,
    compute_block_hashes,
    compute_hashes,
    compute_seq_hashes,
    sequence_hash,
)
from dynamo.llm.kv_events.protocols import EventError, KvEvent, kv_event, parse_kv_event, removed_data, stored_data

__all__ = [
    "KV_HASH_SEED", "block_hash", "compute_block_hashes", "compute_hashes", "compute_seq_hashes",
    "sequence_hash", "ApproxKvIndexer", "KvIndexer", "RadixTree", "EventError", "KvEvent", "kv_event",
    "parse_kv_event", "removed_data", "stored_data", "KvRouter", "RoutingDecision", "ActiveSequences",
]

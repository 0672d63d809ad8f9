"""KV-aware routing: block hashing, the block indexer, the approximate indexer, the cost-based
scheduler and :class:`KvRouter`, which ties them together.  See docs/routing.md."""

from dynamo.kv.events import EventError, KvEvent, kv_event, parse_kv_event, removed_data, stored_data
from dynamo.kv.hashing import (
    KV_HASH_SEED,
    block_hash,
    compute_block_hashes,
    compute_hashes,
    compute_seq_hashes,
    sequence_hash,
)
from dynamo.kv.indexer import ApproxKvIndexer, KvIndexer, RadixTree
from dynamo.kv.router import KvRouter, RoutingDecision
from dynamo.kv.scheduler import ActiveSequences

__all__ = [
    "KV_HASH_SEED", "block_hash", "compute_block_hashes", "compute_hashes", "compute_seq_hashes",
    "sequence_hash", "ApproxKvIndexer", "KvIndexer", "RadixTree", "EventError", "KvEvent", "kv_event",
    "parse_kv_event", "removed_data", "stored_data", "KvRouter", "RoutingDecision", "ActiveSequences",
]

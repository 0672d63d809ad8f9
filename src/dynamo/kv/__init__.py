"""KV-aware routing: block hashing, the block indexer, the approximate indexer, the cost-based
scheduler and :class:`KvRouter`, which ties them together; and Dynamo's Python API to the index
(``RadixTree``, ``OverlapScores``, ``compute_block_hash_for_seq``, api.py).  See docs/routing.md."""

from dynamo.kv.api import OverlapScores, RadixTree, compute_block_hash_for_seq
from dynamo.kv.events import EventError, KvEvent, kv_event, parse_kv_event, removed_data, stored_data
from dynamo.kv.hashing import (
    KV_HASH_SEED,
    block_hash,
    compute_block_hashes,
    compute_hashes,
    compute_seq_hashes,
    sequence_hash,
)
from dynamo.kv.indexer import ApproxKvIndexer, BlockIndex, KvIndexer
from dynamo.kv.router import KvRouter, RoutingDecision
from dynamo.kv.scheduler import ActiveSequences

__all__ = [
    "KV_HASH_SEED", "block_hash", "compute_block_hashes", "compute_hashes", "compute_seq_hashes",
    "sequence_hash", "ApproxKvIndexer", "BlockIndex", "KvIndexer", "EventError", "KvEvent", "kv_event",
    "parse_kv_event", "removed_data", "stored_data", "KvRouter", "RoutingDecision", "ActiveSequences",
    "OverlapScores", "RadixTree", "compute_block_hash_for_seq",
]

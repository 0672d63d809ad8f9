"""Dynamo's Python API for the KV router's index: ``RadixTree``, ``OverlapScores`` and
``compute_block_hash_for_seq``, with the signatures and results of ``dynamo.llm`` in Dynamo 1.x.

These are what a user script drives by hand (replaying a trace of KV events, testing a routing policy)
without a runtime; the router itself uses :class:`dynamo.kv.indexer.KvIndexer`.  Here they are a thin
layer over the same :class:`~dynamo.kv.indexer.BlockIndex`, so a script sees exactly the prefixes the
router would.

What Dynamo defines and this layer keeps:

* A worker is ``(worker_id, dp_rank)``: ``apply_event(worker_id, event)`` takes the rank from the
  event's ``dp_rank`` (0 when absent); scores are keyed by the pair.  ``remove_worker`` and
  ``clear_all_blocks`` (and a ``"cleared"`` event) drop every rank of the worker.
* A worker's score is the number of leading blocks of the query it holds, without a gap.
* ``early_exit=True`` stops the walk once a single worker is left: that worker scores the depth
  reached then, not its whole prefix.
* ``frequencies`` are kept only when the tree has an ``expiration_duration_secs``: for each block
  looked at, how many earlier queries looked at it within that many seconds (zeros left out).
* ``apply_event`` raises ValueError for an event it cannot decode, RuntimeError when a stored
  event's parent or a removed block is not one the worker holds (the rest of a removal still applies).

Differences are listed in docs/routing.md ("Python API").
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable, Sequence

from dynamo.kv.events import EventError, parse_cache_event
from dynamo.kv.hashing import MASK64, block_hash_mm, compute_block_hashes, compute_seq_hashes
from dynamo.kv.indexer import JSON_PARENT_UNKNOWN, BlockIndex

__all__ = ["OverlapScores", "RadixTree", "compute_block_hash_for_seq"]

# The index keys a worker by the pair Dynamo reports it by, (worker_id, dp_rank): find_matches then hands
# the index's answer over as it is, with no conversion per worker.

# how many queries between two sweeps of expired access times (bounds the memory frequencies use)
_SWEEP_EVERY = 1024


def _check_worker_id(worker_id: int) -> int:
    if isinstance(worker_id, bool) or not isinstance(worker_id, int):
        raise TypeError(f"worker_id must be an int, not {type(worker_id).__name__}")
    if not 0 <= worker_id <= MASK64:
        raise OverflowError(f"worker_id must be an unsigned 64-bit integer, got {worker_id}")
    return worker_id


class OverlapScores:
    """What :meth:`RadixTree.find_matches` found: ``scores`` maps ``(worker_id, dp_rank)`` to the number
    of leading blocks of the query that worker holds (workers with none are absent); ``frequencies``
    are the recent-access counts of the blocks looked at (see :class:`RadixTree`)."""

    __slots__ = ("_scores", "_frequencies")

    def __init__(self, scores: dict[tuple[int, int], int], frequencies: list[int]) -> None:
        self._scores = scores
        self._frequencies = frequencies

    @property
    def scores(self) -> dict[tuple[int, int], int]:
        return dict(self._scores)  # a copy each time, as Dynamo's getter returns

    @property
    def frequencies(self) -> list[int]:
        return list(self._frequencies)

    def __repr__(self) -> str:
        return f"OverlapScores(scores={self._scores!r}, frequencies={self._frequencies!r})"


class RadixTree:
    """Which worker holds which prefix, fed KV cache events one at a time.

    ``expiration_duration_secs``: keep per-block access times for this long and report them as
    ``OverlapScores.frequencies``; None (the default) keeps none and ``frequencies`` is empty.

    Not thread-safe (Dynamo's serializes calls on a thread of its own): call it from one thread.
    """

    def __init__(self, expiration_duration_secs: float | None = None) -> None:
        if expiration_duration_secs is not None and expiration_duration_secs < 0:
            raise ValueError("expiration_duration_secs must not be negative")
        self._index = BlockIndex()
        self._expiration = expiration_duration_secs
        self._uses: dict[int, deque[float]] = {}  # sequence hash -> times it was looked at, oldest first
        self._queries = 0

    # -- events --------------------------------------------------------------------------------
    def apply_event(self, worker_id: int, kv_cache_event_bytes: bytes) -> None:
        """Apply one KV cache event that ``worker_id`` published::

            {"event_id": 1, "data": {"stored": {"parent_hash": null,
                                                "blocks": [{"block_hash": 11, "tokens_hash": 7}]}}}
            {"event_id": 2, "data": {"removed": {"block_hashes": [11]}}}
            {"event_id": 3, "data": "cleared"}

        with an optional ``"dp_rank"`` (default 0).  ``block_hash`` is the worker's name for a block,
        ``tokens_hash`` the local hash of its tokens (:func:`compute_block_hash_for_seq`)."""
        _check_worker_id(worker_id)
        if isinstance(kv_cache_event_bytes, (bytes, str)):
            # parsed and applied in C in one pass (rank 0 stored/removed: what engines send); the rest,
            # errors included, is decoded below
            code = self._index.apply_json(kv_cache_event_bytes, (worker_id, 0))
            if code == 0:
                return
            if code == JSON_PARENT_UNKNOWN:
                raise RuntimeError("Failed to apply event: parent block not found")
            if code > 0:
                raise RuntimeError("Failed to apply event: block not found")
        try:
            event, dp_rank = parse_cache_event(worker_id, kv_cache_event_bytes)
        except EventError as e:
            raise ValueError(f"Failed to deserialize KvCacheEvent: {e}") from None
        if event.kind == "cleared":
            self.clear_all_blocks(worker_id)
            return
        key = (worker_id, dp_rank)
        if event.kind == "stored":
            if not self._index.apply_stored(key, event.parent_hash, event.blocks):
                raise RuntimeError("Failed to apply event: parent block not found")
        elif self._index.apply_removed(key, event.block_hashes):
            raise RuntimeError("Failed to apply event: block not found")

    def remove_worker(self, worker_id: int) -> None:
        """Forget every block of ``worker_id``, all its data-parallel ranks."""
        _check_worker_id(worker_id)
        for key in self._index.workers():
            if key[0] == worker_id:
                self._index.remove_worker(key)

    def clear_all_blocks(self, worker_id: int) -> None:
        """Forget every block of ``worker_id`` (what a ``"cleared"`` event does).  Dynamo keeps the
        worker listed with no blocks, which no call here can tell from :meth:`remove_worker`."""
        self.remove_worker(worker_id)

    # -- queries -------------------------------------------------------------------------------
    def find_matches(self, sequence: Sequence[int], early_exit: bool = False) -> OverlapScores:
        """Score each worker by how many leading blocks of ``sequence`` (local block hashes, as
        :func:`compute_block_hash_for_seq` returns) it holds.  ``early_exit``: stop once one worker is
        left (it is credited the depth reached then)."""
        # the sequence hashes are chained in C as the walk goes, only as far as some worker matches
        found, looked_at = self._index.walk_local(sequence, early_exit)
        frequencies = [] if self._expiration is None else self._count_uses(compute_seq_hashes(sequence[:looked_at]))
        return OverlapScores(found, frequencies)

    def _count_uses(self, seq_hashes: Iterable[int]) -> list[int]:
        assert self._expiration is not None
        now = time.monotonic()
        horizon = now - self._expiration
        uses = self._uses
        out = []
        for s in seq_hashes:
            times = uses.get(s)
            if times is None:
                times = uses[s] = deque()
            while times and times[0] < horizon:
                times.popleft()
            if times:
                out.append(len(times))
            times.append(now)
        self._queries += 1
        if self._queries % _SWEEP_EVERY == 0:
            for s in [s for s, times in uses.items() if times[-1] < horizon]:
                del uses[s]
        return out


def compute_block_hash_for_seq(tokens: Sequence[int], kv_block_size: int,
                               block_mm_infos: Sequence[dict[str, Any] | None] | None = None,
                               lora_name: str | None = None) -> list[int]:
    """The local hash of each *complete* block of ``tokens`` (a partial last block has none): what
    workers send as ``tokens_hash`` and what :meth:`RadixTree.find_matches` takes.

    ``block_mm_infos``: per block, None or ``{"mm_objects": [{"mm_hash": <u64>, ...}, ...]}``, the
    multimodal objects the block shows; their hashes go into that block's hash.  ``lora_name``: the blocks
    were computed under that LoRA adapter, whose name salts the hashes (an empty name is none)."""
    if kv_block_size == 0:
        raise ValueError("kv_block_size cannot be 0")
    if kv_block_size < 0:
        raise OverflowError("kv_block_size must not be negative")
    hashes = compute_block_hashes(tokens, kv_block_size, lora_name)
    if block_mm_infos:
        for i, info in enumerate(block_mm_infos[:len(hashes)]):
            if info is None:
                continue
            try:
                mm = [obj["mm_hash"] for obj in info["mm_objects"]]
            except (KeyError, TypeError):
                raise ValueError("each block_mm_infos entry must be None or "
                                 "{'mm_objects': [{'mm_hash': int}, ...]}") from None
            start = i * kv_block_size
            hashes[i] = block_hash_mm(tokens[start:start + kv_block_size], mm, lora_name)
    return hashes

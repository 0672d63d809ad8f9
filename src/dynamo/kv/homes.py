"""Where the router last sent each prefix, for breaking ties between equally good workers.

The KV index says what the engines hold *now*; once every engine has evicted a group's system prompt, a
new conversation of that group is a miss everywhere, every idle worker costs the same, and a uniform
tie-break sends it to either.  Over a run the group's conversations then spread over all workers, each
worker's cache holds every group a little, and evicts more.  The text-tree routers (sglang-router's and
vllm-router's ``cache_aware``) remember where they sent a prefix for minutes, whatever the engine evicted,
and send it there again: a group keeps one home, and that worker's cache keeps that group's sequences.
Measured on two llama.cpp engines of 4 slots (benchmarks/router/peers.py, docs/routing.md): the
difference between their engine hit shares and ours was mostly these cold misses.

:class:`PrefixHomes` keeps that memory for ties only: the cost model still decides, and a worker that is
cheaper (idle, or holding more of the prompt) still wins; among workers of equal cost the one the
prefix's longest remembered part was last sent to is taken.  It remembers the sequence hash at block
counts 1, 2, 4, 8, ... of each routed prompt (a logarithmic number of entries per decision, so a
4,096-token prompt of 256 blocks costs 9 dict writes), in a bounded LRU map.

The bound (``DYN_ROUTER_PREFIX_HOMES_SIZE``, default 32,768 entries): an entry costs 124 bytes (the OrderedDict's
slot and link and the hash's int, measured with tracemalloc), so 4 MB.  With unique prompts every
decision adds ~4-9 entries, so the map fills in ~5,000 decisions and then stays flat; it was 131,072
entries (16 MB), which at 19 requests/s (a first soak's rate) took half an hour to fill: the frontend's RSS "still
rising" after 900 s of load was mostly this map and the segment cache.  32k entries still remember
the last 3,600-8,000 routed prompts, minutes at the rates a tie-break helps (docs/routing.md).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Collection, Sequence

from dynamo.bounds import track

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1 << 15  # entries: 4 MB; ~4-9 per decision, so the last 3,600-8,000 decisions
CAPACITY_ENV = "DYN_ROUTER_PREFIX_HOMES_SIZE"


def capacity_from_env() -> int:
    """``DYN_ROUTER_PREFIX_HOMES_SIZE``; a value that is not a positive whole number is warned about and
    the default used (as ``DYN_ROUTER_PREFIX_HOMES`` is: a knob of a tie-break never stops a frontend)."""
    raw = os.environ.get(CAPACITY_ENV, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        log.warning("%s=%r is not a positive whole number; using %d", CAPACITY_ENV, raw, DEFAULT_CAPACITY)
        return DEFAULT_CAPACITY
    return value


def checkpoints(n: int) -> list[int]:
    """Block counts 1, 2, 4, ... up to ``n``, and ``n`` itself (the whole prompt)."""
    out = []
    k = 1
    while k < n:
        out.append(k)
        k <<= 1
    if n:
        out.append(n)
    return out


class PrefixHomes:
    """Sequence hash (at a checkpoint) -> the worker a prompt with that prefix was last routed to."""

    __slots__ = ("capacity", "_home", "__weakref__")

    def __init__(self, capacity: int | None = None):
        capacity = capacity_from_env() if capacity is None else capacity
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._home: OrderedDict[int, int] = OrderedDict()
        track("kv_prefix_homes", self, len)

    def __len__(self) -> int:
        return len(self._home)

    def record(self, seq_hashes: Sequence[int], worker: int) -> None:
        home = self._home
        for k in checkpoints(len(seq_hashes)):
            h = seq_hashes[k - 1]
            home[h] = worker
            home.move_to_end(h)
        while len(home) > self.capacity:
            home.popitem(last=False)

    def pick(self, seq_hashes: Sequence[int], among: Collection[int]) -> int | None:
        """Of ``among``, the worker the longest remembered prefix of the prompt was last sent to (None if
        none of them)."""
        home = self._home
        for k in reversed(checkpoints(len(seq_hashes))):
            w = home.get(seq_hashes[k - 1])
            if w is not None and w in among:
                return w
        return None

    def forget_worker(self, worker: int) -> None:
        for h in [h for h, w in self._home.items() if w == worker]:
            del self._home[h]

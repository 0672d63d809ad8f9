"""The router's own view of each worker's load, and the cost that picks a worker (spec 7.9, [0.4]).

Per worker, :class:`ActiveSequences` tracks the requests this router sent there and has not seen finish:

* ``active_blocks``: the number of *unique* blocks those requests occupy (shared prefixes count once);
* ``active_tokens``: the prompt tokens still to prefill, summed over requests that have not produced
  their first token yet.

For a new request of ``isl`` tokens whose first ``o_w`` blocks are cached on worker ``w``::

    prefill_tokens_w = (isl - o_w * block_size) + active_tokens_w
    decode_blocks_w  = |request blocks not already active on w| + active_blocks_w
    logit_w          = overlap_score_weight * prefill_tokens_w / block_size + decode_blocks_w

Lower is better.  Temperature 0 picks the minimum, breaking ties uniformly at random; a temperature
T > 0 samples from a softmax of the negated, range-normalised logits divided by T.

A request's blocks are the sequence hashes of its complete blocks plus, for a partial tail, one block
private to the request (it can never be shared).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

WorkerId = int


@dataclass(slots=True)
class _Req:
    blocks: tuple[int | str, ...]
    prefill_tokens: int
    prefilling: bool = True


@dataclass
class ActiveSequences:
    """One worker's in-flight requests, as far as this router knows."""

    requests: dict[str, _Req] = field(default_factory=dict)
    block_refs: dict[int | str, int] = field(default_factory=dict)
    active_tokens: int = 0

    @property
    def active_blocks(self) -> int:
        return len(self.block_refs)

    def new_blocks(self, blocks: Iterable[int | str]) -> int:
        """How many of ``blocks`` are not already held by an active request here."""
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        return len(blocks) - sum(map(self.block_refs.__contains__, blocks))

    def add_request(self, request_id: str, blocks: Sequence[int | str], prefill_tokens: int) -> None:
        if request_id in self.requests:
            self.free(request_id)
        req = _Req(tuple(blocks), max(0, prefill_tokens))
        self.requests[request_id] = req
        refs = self.block_refs
        for b in req.blocks:
            refs[b] = refs.get(b, 0) + 1
        self.active_tokens += req.prefill_tokens

    def mark_prefill_completed(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or not req.prefilling:
            return False
        req.prefilling = False
        self.active_tokens -= req.prefill_tokens
        return True

    def free(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.prefilling:
            self.active_tokens -= req.prefill_tokens
        refs = self.block_refs
        for b in req.blocks:
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
        return True


@dataclass(frozen=True, slots=True)
class WorkerCost:
    worker_id: WorkerId
    overlap_blocks: int
    prefill_tokens: int
    decode_blocks: int
    logit: float


def compute_costs(workers: Sequence[WorkerId], overlaps: Mapping[WorkerId, int], request_blocks: Sequence[int | str],
                  isl: int, block_size: int, overlap_score_weight: float,
                  trackers: Mapping[WorkerId, ActiveSequences]) -> list[WorkerCost]:
    costs = []
    empty = ActiveSequences()
    for w in workers:
        seqs = trackers.get(w, empty)
        o = overlaps.get(w, 0)
        prefill = max(0, isl - o * block_size) + seqs.active_tokens
        decode = seqs.new_blocks(request_blocks) + seqs.active_blocks
        logit = overlap_score_weight * prefill / block_size + decode
        costs.append(WorkerCost(w, o, prefill, decode, logit))
    return costs


def softmax_probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """Spec 7.9's softmax over costs: lower cost, higher probability; uniform when all are equal."""
    n = len(logits)
    lo, hi = min(logits), max(logits)
    if hi == lo:
        return [1.0 / n] * n
    span = hi - lo
    xs = [-(v / span) / temperature for v in logits]
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def select_worker(costs: Sequence[WorkerCost], temperature: float, rng: random.Random) -> WorkerCost:
    if not costs:
        raise ValueError("no workers to choose from")
    if temperature <= 0:
        best = min(c.logit for c in costs)
        # ties within rounding error (0.1 * 48 / 16 + 2 vs 0.1 * 32 / 16 + 3) are ties
        limit = best + 1e-9 * max(1.0, abs(best))
        return rng.choice([c for c in costs if c.logit <= limit])
    probs = softmax_probabilities([c.logit for c in costs], temperature)
    return rng.choices(costs, weights=probs, k=1)[0]

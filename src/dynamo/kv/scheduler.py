"""The router's own view of each worker's load, and the cost that picks a worker.

Per worker, :class:`ActiveSequences` tracks the requests this router sent there and has not seen finish:

* ``active_blocks``: the number of *unique* blocks those requests occupy (shared prefixes count once);
* ``decoding_blocks``: the same, over the requests past their prefill (first token seen) only;
* ``active_tokens``: the prompt tokens still to prefill, summed over requests that have not produced
  their first token yet.

For a new request of ``isl`` tokens whose first ``o_w`` blocks are cached on worker ``w``, and whose first
``f_w`` blocks are blocks of requests in flight there::

    prefill_tokens_w = (isl - max(o_w, f_w) * block_size) + active_tokens_w
    decode_blocks_w  = |request blocks not already active on w| + decoding_blocks_w
    logit_w          = overlap_score_weight * prefill_tokens_w / block_size + decode_blocks_w

A request still prefilling is charged once, in ``active_tokens``; its blocks join the decode load with
its first token.  Charged twice (Dynamo's formula counts every active block as decode load), a worker
prefilling a cold prompt looked dearer than an idle one by that prompt's blocks on top of its tokens,
and a conversation's next turn went to compute its whole history again elsewhere: in the peers
benchmark (docs/routing.md) one such decision cost 7.6 s against about 1 s for the hit, and was the
whole of the difference between our mean and sglang-router's in that run.

Offloaded blocks (docs/routing.md): ``r_w``, the blocks past ``o_w`` that worker ``w`` can restore from
host memory or disk, each weighted by its tier (``KvRouter.tier_weights``), also come off the prefill:
``prefill_tokens_w = (isl - (o_w + r_w) * block_size) + active_tokens_w``.

``f_w`` counts as cached because it will be by the time this request is prefilled: an engine reports a
block only after computing it (llama.cpp after the prefill step that completes it, so the event reaches
the router about when the first token does), while the request that computes it is already booked here
from the moment it was routed.  Without it, the second request of a prefix routed in that window saw a
full miss everywhere and went to whichever worker was idle, computing the prefix a second time; with it,
it follows the first one unless that worker's pending prefill (``active_tokens_w``, the first request's
included) makes it dearer.  A worker that computes a prefix another slot is still computing waits for it
and copies it (llama.cpp; the mocker shares active blocks), so the credit is real.

``active_tokens_w`` counts only what is left of the prefill in progress (:meth:`ActiveSequences.
prefill_progress`): the router measures each worker's prefill rate from its own bookings (prompt tokens
booked / time from routing to the first token, on the oldest prefill only, as the others wait for it; an
exponential average) and takes off the oldest pending prefill what that rate says is done.  Counted whole
until its first token, a long prefill that was almost done made the worker holding a prefix look busy for
its whole length, and the router sent the prefix's requests to compute it again on an idle worker.  The
fast pick over 64 workers or more (below) counts pending prefills whole for the workers the prompt does not
touch (its index is static), so it leans a little towards the touched ones.

Lower is better.  Temperature 0 picks the minimum, breaking ties uniformly at random; a temperature
T > 0 samples from a softmax of the negated, range-normalised logits divided by T.

A request's blocks are the sequence hashes of its complete blocks plus, for a partial tail, one block
private to the request (it can never be shared).

**Cost of a decision.**  The blocks of a request are *prefix-closed*: a sequence hash names its block and
everything before it, so a worker that has block ``i`` of the request active has blocks ``0..i-1`` active
too (the request that holds it started with the same prefix).  So the request blocks already active on a
worker are a prefix of the request's blocks, found by binary search (:meth:`ActiveSequences.shared_prefix`,
a few dict lookups) instead of one lookup per block per worker; and a worker with nothing in flight costs
no lookup at all.  A hot prefix in flight on many workers usually ends at the same block on each, so the
last answer is tried first.  With 1,000 workers and 4k-token prompts this took the cost computation from
about 6 ms to about 0.7 ms (benchmarks/router/scale.py; docs/routing.md).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Collection, Generator, Iterable, Mapping, NamedTuple, Sequence

WorkerId = int


@dataclass(slots=True)
class _Req:
    blocks: tuple[int | str, ...]
    prefill_tokens: int
    prefilling: bool = True
    routed_at: float = 0.0


PREFILL_RATE_ALPHA = 0.3  # weight of the newest sample in a worker's prefill rate (an exponential average)


@dataclass(slots=True)
class ActiveSequences:
    """One worker's in-flight requests, as far as this router knows.

    Besides the block reference counts it keeps two things a decision reads for every worker, so that
    reading them touches this object only: ``num_blocks`` (= ``len(block_refs)``) and ``heads``, the first
    blocks of its requests (a request's blocks are prefix-closed, so a request shares blocks with this
    worker's in-flight ones exactly when its first block is one of these)."""

    requests: dict[str, _Req] = field(default_factory=dict)
    block_refs: dict[int | str, int] = field(default_factory=dict)
    active_tokens: int = 0
    num_blocks: int = 0
    heads: dict[int | str, int] = field(default_factory=dict)
    # the unique blocks of the requests past their prefill: the decode load (a request still prefilling is
    # charged in ``active_tokens`` instead, not twice)
    decode_refs: dict[int | str, int] = field(default_factory=dict)
    decoding_blocks: int = 0
    # the requests still prefilling, oldest first, and what the worker's past prefills say of its speed
    prefilling: dict[str, _Req] = field(default_factory=dict)
    prefill_rate: float = 0.0  # prompt tokens per second (0: not measured yet)
    prefill_done_at: float = 0.0  # when its last prefill ended (the next one in line started then)

    @property
    def active_blocks(self) -> int:
        return self.num_blocks

    def new_blocks(self, blocks: Iterable[int | str]) -> int:
        """How many of ``blocks`` are not already held by an active request here (any blocks)."""
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        return len(blocks) - sum(map(self.block_refs.__contains__, blocks))

    def shared_prefix(self, blocks: Sequence[int | str], hint: int = 0) -> int:
        """How many leading ``blocks`` are active here, for prefix-closed request blocks (see above):
        the active ones are a prefix, so a binary search finds where it ends.  ``hint``, a guess (the
        answer for another worker: a hot prefix is in flight on many), is checked first in two lookups."""
        refs = self.block_refs
        if not refs or not blocks or blocks[0] not in refs:
            return 0
        n = len(blocks)
        if 0 < hint < n and blocks[hint - 1] in refs and blocks[hint] not in refs:
            return hint
        lo, hi = 1, n  # blocks[:lo] are active; blocks[hi:] are not
        if blocks[hi - 1] in refs:
            return hi
        hi -= 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if blocks[mid] in refs:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def add_request(self, request_id: str, blocks: Sequence[int | str], prefill_tokens: int,
                    now: float = 0.0) -> None:
        if request_id in self.requests:
            self.free(request_id)
        req = _Req(tuple(blocks), max(0, prefill_tokens), routed_at=now)
        self.requests[request_id] = req
        self.prefilling[request_id] = req
        refs = self.block_refs
        for b in req.blocks:
            refs[b] = refs.get(b, 0) + 1
        self.num_blocks = len(refs)
        if req.blocks:
            head = req.blocks[0]
            self.heads[head] = self.heads.get(head, 0) + 1
        self.active_tokens += req.prefill_tokens

    def mark_prefill_completed(self, request_id: str, now: float | None = None) -> bool:
        """The request's first token came (at ``now``, on the router's clock: then, if it was the oldest
        prefill here, it also measures the worker's prefill rate)."""
        req = self.requests.get(request_id)
        if req is None or not req.prefilling:
            return False
        req.prefilling = False
        self.active_tokens -= req.prefill_tokens
        refs = self.decode_refs
        for b in req.blocks:
            refs[b] = refs.get(b, 0) + 1
        self.decoding_blocks = len(refs)
        oldest = next(iter(self.prefilling), None) == request_id
        del self.prefilling[request_id]
        if now is not None and oldest:
            took = now - max(req.routed_at, self.prefill_done_at)
            if took > 0 and req.prefill_tokens > 0:
                rate = req.prefill_tokens / took
                self.prefill_rate = rate if not self.prefill_rate else (
                    PREFILL_RATE_ALPHA * rate + (1 - PREFILL_RATE_ALPHA) * self.prefill_rate)
            self.prefill_done_at = now
        return True

    def prefill_progress(self, now: float) -> int:
        """Prompt tokens of the oldest pending prefill that the worker has computed by ``now``, as far as
        its measured rate says (0 before it has one): that request is the one in progress, the others wait
        for it."""
        if not self.prefill_rate or not self.prefilling:
            return 0
        req = next(iter(self.prefilling.values()))
        elapsed = now - max(req.routed_at, self.prefill_done_at)
        return min(req.prefill_tokens, int(self.prefill_rate * elapsed)) if elapsed > 0 else 0

    def current_prefill_left(self, now: float | None) -> int:
        """Prompt tokens left of the prefill in progress (the oldest), as far as the measured rate says:
        how long anything that needs this worker's next step boundary waits (None: all of it)."""
        if not self.prefilling:
            return 0
        req = next(iter(self.prefilling.values()))
        return req.prefill_tokens - (0 if now is None else self.prefill_progress(now))

    def pending_tokens(self, now: float | None) -> int:
        """``active_tokens`` less what the oldest prefill has done by ``now`` (None: all of it pending)."""
        return self.active_tokens if now is None else self.active_tokens - self.prefill_progress(now)

    def free(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.prefilling:
            self.active_tokens -= req.prefill_tokens
            del self.prefilling[request_id]
        else:
            self.decoding_blocks = _unref(self.decode_refs, req.blocks)
        self.num_blocks = _unref(self.block_refs, req.blocks)
        if req.blocks:
            heads, head = self.heads, req.blocks[0]
            n = heads[head] - 1
            if n:
                heads[head] = n
            else:
                del heads[head]
        return True


class WorkerCost(NamedTuple):
    worker_id: WorkerId
    overlap_blocks: int
    prefill_tokens: int
    decode_blocks: int
    logit: float


class CostTable(Sequence[WorkerCost]):
    """The costs of one decision, column by column: a :class:`WorkerCost` is only built when one is looked
    at (the chosen worker, a debug log, a test), not one object per worker per decision."""

    __slots__ = ("workers", "overlaps", "prefill", "decode", "logits")

    def __init__(self, workers: Sequence[WorkerId], overlaps: Mapping[WorkerId, int], prefill: list[int],
                 decode: list[int], logits: list[float]):
        self.workers = workers
        self.overlaps = overlaps
        self.prefill = prefill
        self.decode = decode
        self.logits = logits

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        w = self.workers[i]
        return WorkerCost(w, self.overlaps.get(w, 0), self.prefill[i], self.decode[i], self.logits[i])

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"CostTable({list(self)!r})"


def compute_costs(workers: Sequence[WorkerId], overlaps: Mapping[WorkerId, int], request_blocks: Sequence[int | str],
                  isl: int, block_size: int, overlap_score_weight: float,
                  trackers: Mapping[WorkerId, ActiveSequences],
                  restorable: Mapping[WorkerId, float] | None = None, now: float | None = None) -> CostTable:
    """The cost of each worker; ``request_blocks`` must be prefix-closed (a request's blocks are).
    ``restorable``: weighted offloaded blocks per worker, beyond its resident prefix (None: no worker has any).
    ``now``: the router's clock, to count only what is left of each worker's prefill in progress
    (:meth:`ActiveSequences.prefill_progress`); None counts all of it.

    One plain loop that reads two numbers and a tiny dict per worker, and builds no object per worker:
    with 1,000 workers it is most of a decision."""
    prefills: list[int] = []
    decodes: list[int] = []
    logits: list[float] = []
    add_p, add_d, add_l = prefills.append, decodes.append, logits.append
    get_tracker, get_overlap = trackers.get, overlaps.get
    n = len(request_blocks)
    first = request_blocks[0] if n else None
    scale = overlap_score_weight / block_size
    workers = workers if isinstance(workers, (list, tuple)) else list(workers)
    hint = 0
    get_restorable = restorable.get if restorable else None
    for w in workers:
        prefill = isl - get_overlap(w, 0) * block_size
        if get_restorable is not None:
            prefill -= int(get_restorable(w, 0.0) * block_size)
        if prefill < 0:
            prefill = 0
        seqs = get_tracker(w)
        if seqs is None:
            decode = n
        else:
            decode = n + seqs.decoding_blocks
            if first in seqs.heads:
                hint = seqs.shared_prefix(request_blocks, hint)
                decode -= hint
                # blocks routed here and not yet reported are computed by then: no prefill for them
                prefill = min(prefill, max(0, isl - hint * block_size))
            prefill += seqs.pending_tokens(now)
        add_p(prefill)
        add_d(decode)
        add_l(scale * prefill + decode)
    return CostTable(workers, overlaps, prefills, decodes, logits)


def softmax_probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """A softmax over costs (the original's): lower cost, higher probability; uniform when all are equal."""
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


def select_worker(costs: Sequence[WorkerCost], temperature: float, rng: random.Random,
                  prefer: Callable[[Collection[WorkerId]], WorkerId | None] | None = None) -> WorkerCost:
    """Temperature 0: the lowest logit; ties go to ``prefer``'s pick among them (the prefix's last home,
    homes.py) if it makes one, else uniformly at random."""
    if not costs:
        raise ValueError("no workers to choose from")
    logits = costs.logits if isinstance(costs, CostTable) else [c.logit for c in costs]
    if temperature <= 0:
        best = min(logits)
        # ties within rounding error (0.1 * 48 / 16 + 2 vs 0.1 * 32 / 16 + 3) are ties
        limit = best + 1e-9 * max(1.0, abs(best))
        ties = [i for i, v in enumerate(logits) if v <= limit]
        if prefer is not None and len(ties) > 1:
            tied = {costs[i].worker_id: i for i in ties}
            home = prefer(tied.keys())
            if home is not None:
                return costs[tied[home]]
        return costs[rng.choice(ties)]
    probs = softmax_probabilities(logits, temperature)
    return costs[rng.choices(range(len(logits)), weights=probs, k=1)[0]]


# -- many workers: visit only those the prompt touches ----------------------------------------------------

FAST_PICK_MIN_WORKERS = 64  # below this, the plain pass over every worker is as fast (and lists all costs)


class BaseCostIndex:
    """Workers grouped by their *base cost*, the part of the logit that does not depend on the prompt::

        base_w = overlap_score_weight / block_size * active_tokens_w + decoding_blocks_w

    For a worker that holds none of the prompt (no cached prefix, no in-flight request sharing its first
    block), ``logit_w = K + base_w`` with ``K = overlap_score_weight * isl / block_size + request blocks``
    the same for all of them.  So the best of those is the lowest base, and a decision computes exact
    costs only for the workers the prompt touches: with 1,000 workers, a few dozen instead of all.

    ``buckets`` maps each base value to its workers (ties are whole buckets, for the uniform random
    tie-break); ``heap`` holds the distinct values, cleaned lazily.  Updated by the router whenever a
    worker's in-flight set changes (add, first token, free).
    """

    __slots__ = ("scale", "base", "buckets", "heap")

    def __init__(self, scale: float):
        self.scale = scale
        self.base: dict[WorkerId, float] = {}
        self.buckets: dict[float, set[WorkerId]] = {}
        self.heap: list[float] = []

    def update(self, worker: WorkerId, seqs: ActiveSequences | None) -> None:
        new = 0.0 if seqs is None else self.scale * seqs.active_tokens + seqs.decoding_blocks
        old = self.base.get(worker)
        if old == new:
            return
        if old is not None:
            self._leave(worker, old)
        self.base[worker] = new
        bucket = self.buckets.get(new)
        if bucket is None:
            self.buckets[new] = {worker}
            heapq.heappush(self.heap, new)
            if len(self.heap) > 2 * len(self.buckets) + 64:
                self.heap = sorted(self.buckets)  # drop the stale values (a sorted list is a heap)
        else:
            bucket.add(worker)

    def remove(self, worker: WorkerId) -> None:
        old = self.base.pop(worker, None)
        if old is not None:
            self._leave(worker, old)

    def _leave(self, worker: WorkerId, value: float) -> None:
        bucket = self.buckets[value]
        bucket.discard(worker)
        if not bucket:
            del self.buckets[value]

    def ascending(self) -> Generator[tuple[float, set[WorkerId]], None, None]:
        """(base, workers) from the lowest base up; stale heap entries are dropped on the way.  The heap is
        whole again once the iteration is closed (the values taken out are put back)."""
        heap, buckets = self.heap, self.buckets
        taken: list[float] = []
        try:
            last = None
            while heap:
                value = heapq.heappop(heap)
                if value == last or value not in buckets:
                    continue  # a duplicate, or a value no worker has any more
                taken.append(value)
                last = value
                yield value, buckets[value]
        finally:
            for value in taken:
                heapq.heappush(heap, value)


class FastPick(NamedTuple):
    choice: WorkerCost
    evaluated: list[WorkerCost]  # the touched workers' exact costs (the rest share K + their base)


def fast_pick(candidates: Iterable[WorkerId], overlaps: Mapping[WorkerId, int], request_blocks: Sequence[int | str],
              isl: int, block_size: int, overlap_score_weight: float,
              trackers: Mapping[WorkerId, ActiveSequences], heads: Mapping[int | str, set[WorkerId]],
              index: BaseCostIndex, rng: random.Random) -> FastPick:
    """Temperature 0: the lowest logit over ``candidates`` (ties uniformly at random), as
    :func:`compute_costs` + :func:`select_worker` would pick, visiting only the touched workers plus the
    lowest base-cost buckets.  ``heads`` maps a block to the workers with an in-flight request starting
    with it; every candidate must be in ``index`` (unknown workers with base 0)."""
    cand = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
    n = len(request_blocks)
    scale = overlap_score_weight / block_size
    k = scale * isl + n
    touched = [w for w in overlaps if w in cand]
    if n:
        sharing = heads.get(request_blocks[0])
        if sharing:
            seen = set(touched)
            touched += [w for w in sharing if w in cand and w not in seen]
    evaluated: list[WorkerCost] = []
    hint = 0
    first = request_blocks[0] if n else None
    for w in touched:
        o = overlaps.get(w, 0)
        prefill = max(0, isl - o * block_size)
        decode = n
        seqs = trackers.get(w)
        if seqs is not None:
            decode += seqs.decoding_blocks
            if first in seqs.heads:
                hint = seqs.shared_prefix(request_blocks, hint)
                decode -= hint
                prefill = min(prefill, max(0, isl - hint * block_size))  # in flight: as in compute_costs
            prefill += seqs.active_tokens
        evaluated.append(WorkerCost(w, o, prefill, decode, scale * prefill + decode))
    touched_set = {c.worker_id for c in evaluated}
    best = min((c.logit for c in evaluated), default=math.inf)
    untouched_best = None
    buckets = index.ascending()
    chosen_buckets: list[tuple[float, set[WorkerId]]] = []
    try:
        for base, workers in buckets:
            current = best if untouched_best is None else min(best, k + untouched_best)
            if k + base > _limit(current):
                break  # this bucket and every higher one lose to what we have
            eligible = (workers & cand) - touched_set
            if not eligible:
                continue
            if untouched_best is None:
                untouched_best = base
            chosen_buckets.append((base, eligible))
    finally:
        buckets.close()
    if untouched_best is not None:
        best = min(best, k + untouched_best)
    if best == math.inf:
        raise ValueError("no workers to choose from")
    limit = _limit(best)
    ties: list[WorkerCost | WorkerId] = [c for c in evaluated if c.logit <= limit]
    for base, eligible in chosen_buckets:
        if k + base <= limit:
            ties.extend(sorted(eligible))
    pick = rng.choice(ties)
    if not isinstance(pick, WorkerCost):
        seqs = trackers.get(pick)
        tokens = seqs.active_tokens if seqs is not None else 0
        blocks = seqs.decoding_blocks if seqs is not None else 0
        prefill = isl + tokens
        pick = WorkerCost(pick, 0, prefill, n + blocks, scale * prefill + n + blocks)
    return FastPick(pick, evaluated)


def _unref(refs: dict, blocks: Sequence) -> int:
    """Drop one reference to each of ``blocks``, forgetting blocks no one holds; the blocks still held."""
    for b in blocks:
        n = refs[b] - 1
        if n:
            refs[b] = n
        else:
            del refs[b]
    return len(refs)


def _limit(best: float) -> float:
    """Logits up to this are ties with ``best`` (rounding: 0.1 * 48 / 16 + 2 against 0.1 * 32 / 16 + 3)."""
    return best + 1e-9 * max(1.0, abs(best))

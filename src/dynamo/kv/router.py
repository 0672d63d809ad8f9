"""``KvRouter``: the indexer (where prefixes are cached) plus the scheduler (what each worker is busy
with) behind three calls the frontend makes per request: ``select`` before sending it,
``on_first_token`` when its first item arrives, ``on_finished`` when its stream ends.

Transport-free: KV events come in through :meth:`KvRouter.apply_event`; what the router has to say goes
out through optional publisher callbacks (publisher.py): the hit-rate event after each decision and,
for router replica sync, the active-sequence events, which peers feed to
:meth:`KvRouter.apply_active_sequence_event`.  Everything runs on one event loop, without locks.

A router that starts (or reconnects) late asks each worker for the blocks it holds (the recovery
query, worker_state.py) and applies the answer with :meth:`KvRouter.apply_dump`; events that arrive
meanwhile are kept (:meth:`KvRouter.begin_resync`) and those newer than the dump are replayed after it.

The active-sequence events are Dynamo 1.6.1's (replica_sync.py), so our routers and 1.6.1's share
their bookings both ways.  Peers' bookings expire: every router of ours sends a heartbeat listing its
in-flight requests every ``peer_ttl / 3`` seconds (:meth:`KvRouter.heartbeat`, through
``publish_active_sequence``); a peer's booking that its heartbeat no longer lists is freed, and so is every
booking of a peer silent for ``peer_ttl`` seconds (a frontend that crashed leaves no phantom load behind).
A router that sends no heartbeats (1.6.1's) frees its bookings itself; each expires after 1.x's own bound.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import orjson

from dynamo.bounds import track
from dynamo.kv import replica_sync as sync
from dynamo.kv.decision_log import DecisionLog
from dynamo.kv.events import (
    DISK,
    HOST,
    LOWER_TIERS,
    EventError,
    KvEvent,
    StoredBlock,
    parse_kv_event,
)
from dynamo.kv.hashing import compute_block_hashes, compute_seq_hashes
from dynamo.kv.homes import PrefixHomes
from dynamo.kv.indexer import DEFAULT_APPROX_TTL_S, ApproxKvIndexer, KvIndexer, Overlaps
from dynamo.kv.publisher import Publisher, emit
from dynamo.kv.scheduler import (
    FAST_PICK_MIN_WORKERS,
    ActiveSequences,
    BaseCostIndex,
    WorkerCost,
    compute_costs,
    fast_pick,
    select_worker,
)

log = logging.getLogger(__name__)

WorkerId = int
DEFAULT_PEER_TTL_S = 10.0
# An offloaded block saves this fraction of a resident block's prefill (docs/decisions.md): restoring
# costs something (a copy back, a read and a checksum), and the entry may be gone when the request comes.
DEFAULT_TIER_WEIGHTS: dict[str, float] = {HOST: 0.8, DISK: 0.5}
# A block another worker holds and the chosen worker can fetch from it (disagg/prefix_share.py) saves this
# fraction of a resident block's prefill (0: the router never names a source): loading a state is
# milliseconds where computing a block is tens (SmolLM2 on one core: 64 ms per 16-token block), but the
# holder answers only between two of its steps.  Only workers that lend are credited (llamacpp workers,
# where DYN_KV_PREFIX_SHARING allows: by default on one machine or with a fleet secret): with none, this
# costs a decision nothing.
DEFAULT_PREFIX_FETCH_WEIGHT = 0.9
PREFIX_FETCH_MIN_BLOCKS = 2  # a fetch saving less than this is not worth a round trip


class _Choice(NamedTuple):
    worker_id: WorkerId
    overlap_blocks: int


class RoutingDecision(_Choice):
    """(worker, its cached blocks), as a pair (callers unpack it), plus ``prefix_source``: (share address,
    tokens) of a worker holding more of the prompt, for the chosen one to fetch from (None: no fetch)."""

    prefix_source: tuple[str, int] | None = None

    def __new__(cls, worker_id: WorkerId, overlap_blocks: int,
                prefix_source: tuple[str, int] | None = None) -> "RoutingDecision":
        self = super().__new__(cls, worker_id, overlap_blocks)
        if prefix_source is not None:
            self.prefix_source = prefix_source
        return self


class KvRouter:
    """KV-aware worker selection for one model (one block size).  ``lora_name``: the model is that LoRA
    adapter, so prompts are hashed with its salt (hashing.py) and match only blocks computed under it.

    ``load_of``: another router over the same workers (a LoRA adapter's router gets its base model's)
    whose bookings this one shares: the requests in flight per worker (with their cost index and
    heads), their owners, the peers' bookings and the router id peers know them by.  A worker busy with
    the adapter's requests is busy for the base model too, and the other way round; each router keeps
    its own prefix index (the adapter's block hashes are salted, so the two never match anyway).  With
    the same router id, a sibling's active-sequence events are its own echoes, never booked twice; only
    the router that owns the bookings forgets a worker's requests when the worker leaves (an adapter
    unloaded from a worker leaves the base model's requests there booked)."""

    def __init__(self, block_size: int = 16, overlap_score_weight: float = 1.0, temperature: float = 0.0,
                 use_kv_events: bool = True, *, approx_ttl: float = DEFAULT_APPROX_TTL_S,
                 seed: int | None = None, clock: Callable[[], float] = time.monotonic,
                 publish_hit_rate: Publisher | None = None,
                 publish_active_sequence: Publisher | None = None,
                 router_id: int | None = None, peer_ttl: float = DEFAULT_PEER_TTL_S,
                 tier_weights: Mapping[str, float] | None = None, lora_name: str | None = None,
                 decision_log: DecisionLog | None = None, load_of: KvRouter | None = None,
                 prefix_homes: bool = True, prefix_fetch_weight: float = DEFAULT_PREFIX_FETCH_WEIGHT):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if overlap_score_weight < 0:
            raise ValueError("overlap_score_weight must be >= 0")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        for tier, weight in self.tier_weights.items():
            if tier not in LOWER_TIERS or not 0 <= weight <= 1:
                raise ValueError(f"tier weight {tier}={weight}: tiers are {LOWER_TIERS}, weights 0..1")
        if not 0 <= prefix_fetch_weight <= 1:
            raise ValueError(f"prefix_fetch_weight {prefix_fetch_weight}: 0..1")
        self.prefix_fetch_weight = prefix_fetch_weight
        # workers that lend and borrow cached prefixes: worker id -> the address they lend them from
        self.lenders: dict[WorkerId, str] = {}
        self.block_size = block_size
        self.lora_name = lora_name or None
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.use_kv_events = use_kv_events
        self.indexer: KvIndexer | ApproxKvIndexer = (
            KvIndexer() if use_kv_events else ApproxKvIndexer(ttl=approx_ttl, clock=clock))
        self.rng = random.Random(seed)
        self.publish_hit_rate = publish_hit_rate
        self.publish_active_sequence = publish_active_sequence
        self.router_id = router_id if router_id is not None else random.getrandbits(64)  # (1.x's: a u64)
        self.seq_events_rejected = 0  # malformed active-sequence events (logged once a minute)
        self._rejected_logged_at = -math.inf
        # told each decision's stages in seconds (block_hashing, seq_hashing: when hashed here,
        # indexer_find_matches, scheduling, total): the frontend's router overhead histograms, or None
        self.overhead: Callable[[dict[str, float]], None] | None = None
        self.trackers: dict[WorkerId, ActiveSequences] = {}
        # for decisions over many workers (scheduler.fast_pick): each worker's base cost, and which
        # workers have an in-flight request starting with a given block
        self._loads = BaseCostIndex(overlap_score_weight / block_size)
        self._heads: dict[int | str, set[WorkerId]] = {}
        self._owner: dict[str, WorkerId] = {}  # request id -> worker it was routed to
        self.clock = clock
        self.peer_ttl = peer_ttl
        self._peer_of: dict[str, int] = {}  # request id -> the peer router that booked it
        self._peer_seen: dict[int, float] = {}  # peer router id -> its last heartbeat (peers that send them)
        # request id -> when a peer booked it, oldest first: the bound on the bookings of peers without heartbeats
        self._peer_booked: dict[str, float] = {}
        self._resync: dict[WorkerId, list[KvEvent]] = {}  # events that arrived while a dump was pending
        self._dumped_upto: dict[WorkerId, int] = {}  # events up to this id are in the applied dump
        self.last_costs: Sequence[WorkerCost] = []  # of the last decision, for logs and tests
        self.decision_log = decision_log  # opt-in JSON lines of decisions and events (decision_log.py)
        # where each prefix was last routed, to break ties between equally good workers (homes.py)
        self.homes: PrefixHomes | None = PrefixHomes() if prefix_homes else None
        self.owns_load = load_of is None
        if load_of is not None:
            if (load_of.block_size, load_of.overlap_score_weight) != (block_size, overlap_score_weight):
                raise ValueError("routers that share their bookings need the same block size and overlap weight")
            self.router_id = load_of.router_id
            self.trackers = load_of.trackers
            self._loads = load_of._loads
            self._heads = load_of._heads
            self._owner = load_of._owner
            self._peer_of = load_of._peer_of
            self._peer_seen = load_of._peer_seen
            self._peer_booked = load_of._peer_booked
        _track_router(self)

    # -- per request ---------------------------------------------------------------------------
    def select(self, token_ids: Sequence[int], workers: Iterable[WorkerId],
               request_id: str | None = None,
               hashes: tuple[list[int], list[int]] | None = None) -> RoutingDecision:
        """Pick a worker for a prompt.  With ``request_id`` the request is tracked as in flight on the
        chosen worker until :meth:`on_finished`; without it the call is a pure query.  ``hashes``: the
        prompt's (local, sequence) block hashes, computed beforehand (``compute_hashes_async`` for a long
        prompt, so that hashing does not hold the event loop)."""
        sink = self.overhead
        clock = time.perf_counter if sink is not None else None
        stages: dict[str, float] = {}
        t0 = clock() if clock is not None else 0.0
        if hashes is None:
            local = compute_block_hashes(token_ids, self.block_size, self.lora_name)
            if clock is not None:
                t1 = clock()
                stages["block_hashing"] = t1 - t0
            seq = compute_seq_hashes(local)
            if clock is not None:
                stages["seq_hashing"] = clock() - t1
        else:
            local, seq = hashes
        if clock is not None:
            t2 = clock()
        overlaps = self.indexer.find_matches(local, seq)
        if clock is not None:
            t3 = clock()
            stages["indexer_find_matches"] = t3 - t2
        lower = self._lower_matches(seq)
        restorable = self._restorable(lower, overlaps)
        holder = self._best_lender(overlaps, lower)
        fetchers: set[WorkerId] = set()  # the workers credited with fetching the holder's prefix
        if holder is not None:
            restorable, fetchers = self._fetchable(holder, overlaps, restorable, self.clock(), seq)
        # offloaded blocks of this prompt somewhere: the full pass, which prices them (the fast pick
        # only knows resident overlaps)
        many = self.temperature <= 0 and not restorable and isinstance(workers, (list, tuple, set, frozenset)) \
            and len(workers) >= FAST_PICK_MIN_WORKERS
        # the fast pick works on a set; the full pass keeps the callers' order (duplicates dropped)
        candidates: Any = set(workers) if many else list(dict.fromkeys(workers))
        if not candidates:
            raise ValueError("no workers to route to")
        if self._peer_seen:
            self.expire_peers()
        blocks = self._request_blocks(seq, len(token_ids))
        costs: Sequence[WorkerCost]
        if many:
            # many workers: exact costs for those the prompt touches, the best of the rest by base cost
            loads = self._loads
            for w in candidates.difference(loads.base):
                loads.update(w, self.trackers.get(w))
            picked = fast_pick(candidates, overlaps, blocks, len(token_ids), self.block_size,
                               self.overlap_score_weight, self.trackers, self._heads, loads, self.rng)
            choice, costs = picked.choice, picked.evaluated
            if choice.worker_id not in {c.worker_id for c in costs}:
                costs = [*costs, choice]
        else:
            costs = compute_costs(candidates, overlaps, blocks, len(token_ids), self.block_size,
                                  self.overlap_score_weight, self.trackers, restorable, now=self.clock())
            homes = self.homes
            prefer = None if homes is None else (lambda among: homes.pick(seq, among))
            choice = select_worker(costs, self.temperature, self.rng, prefer)
        self.last_costs = costs
        if sink is not None and clock is not None:
            t4 = clock()
            stages["scheduling"] = t4 - t3
            stages["total"] = t4 - t0
            sink(stages)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kv route: %d tokens -> worker %x (overlap %d blocks); costs %s; overlaps %s%s",
                      len(token_ids), choice.worker_id, choice.overlap_blocks,
                      {f"{c.worker_id:x}": round(c.logit, 2) for c in costs},
                      {f"{c.worker_id:x}": c.overlap_blocks for c in costs},
                      "" if len(costs) == len(candidates) else
                      f" ({len(candidates) - len(costs)} other workers hold none of the prompt)")
            if restorable:
                log.debug("kv route: restorable (weighted blocks) %s",
                          {f"{w:x}": round(v, 2) for w, v in restorable.items()})
        if isinstance(self.indexer, ApproxKvIndexer):
            self.indexer.process_routing_decision(choice.worker_id, local, seq)
        source = None
        if holder is not None and choice.worker_id in fetchers:
            tracker = self.trackers.get(choice.worker_id)
            has = max(choice.overlap_blocks, tracker.shared_prefix(blocks) if tracker is not None else 0)
            if holder[1] - has >= PREFIX_FETCH_MIN_BLOCKS:  # (a prefix it is computing already: no fetch)
                source = (self.lenders[holder[0]], holder[1] * self.block_size)
        if self.decision_log is not None:
            self._log_decision(request_id, choice.worker_id, len(token_ids), blocks, costs,
                               holder[:2] if holder is not None and source is not None else None)
        if request_id is not None:
            tracker = self.trackers.get(choice.worker_id)
            inflight = tracker.shared_prefix(blocks) if tracker is not None else 0
            fetched = source[1] // self.block_size if source is not None else 0
            prefill = len(token_ids) - max(choice.overlap_blocks, inflight, fetched) * self.block_size
            self._add(request_id, choice.worker_id, blocks, prefill)
            if self.homes is not None:
                self.homes.record(seq, choice.worker_id)
            if self.publish_active_sequence is not None:
                emit(self.publish_active_sequence, sync.add_request(
                    request_id, choice.worker_id, self.router_id, seq, len(token_ids), prefill, self.lora_name),
                    "active sequence event")
        emit(self.publish_hit_rate, {"worker_id": choice.worker_id, "isl_blocks": len(local),
                                     "overlap_blocks": choice.overlap_blocks}, "kv hit rate event")
        return RoutingDecision(choice.worker_id, choice.overlap_blocks, source)

    def add_request(self, request_id: str, token_ids: Sequence[int], worker_id: WorkerId,
                    overlap_blocks: int = 0) -> None:
        """Track a request routed without :meth:`select` (e.g. ``backend_instance_id`` was given)."""
        seq = compute_seq_hashes(compute_block_hashes(token_ids, self.block_size, self.lora_name))
        blocks = self._request_blocks(seq, len(token_ids))
        prefill = len(token_ids) - overlap_blocks * self.block_size
        self._add(request_id, worker_id, blocks, prefill)
        if self.publish_active_sequence is not None:
            emit(self.publish_active_sequence, sync.add_request(
                request_id, worker_id, self.router_id, seq, len(token_ids), prefill, self.lora_name),
                "active sequence event")

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is done on its worker: its prompt no longer counts as pending work."""
        worker = self._owner.get(request_id)
        if self.decision_log is not None and worker is not None:
            self.decision_log.write({"ev": "first", "id": request_id})
        if worker is not None and self._mark(worker, request_id) and self.publish_active_sequence is not None:
            emit(self.publish_active_sequence,
                 sync.mark_prefill_completed(request_id, worker, self.router_id, self.lora_name),
                 "active sequence event")

    def on_finished(self, request_id: str) -> None:
        """The request's stream ended (any way): its blocks no longer count against the worker."""
        worker = self._owner.pop(request_id, None)
        if worker is None:
            return
        if self.decision_log is not None:
            self.decision_log.write({"ev": "done", "id": request_id})
        self._free(worker, request_id)
        if self.publish_active_sequence is not None:
            emit(self.publish_active_sequence, sync.free(request_id, worker, self.router_id, self.lora_name),
                 "active sequence event")

    # -- inputs from the outside ---------------------------------------------------------------
    def apply_event(self, event: KvEvent | bytes | str | dict[str, Any]) -> bool:
        """One KV event from a worker (raw JSON or parsed).  Ignored when not using KV events."""
        if isinstance(self.indexer, ApproxKvIndexer):
            return False
        if self._resync or self._dumped_upto or self.decision_log is not None:
            if not isinstance(event, KvEvent):
                try:
                    event = parse_kv_event(event)
                except EventError as e:
                    self.indexer.events_rejected += 1
                    log.warning("undecodable KV event skipped: %s", e)
                    return False
            upto = self._dumped_upto.get(event.worker_id)
            if upto is not None and event.event_id <= upto:
                return False  # already part of the dump we applied
            pending = self._resync.get(event.worker_id)
            if pending is not None:
                pending.append(event)
            if self.decision_log is not None:
                self.decision_log.write({"ev": event.kind, "worker": f"{event.worker_id:x}", "tier": event.tier,
                                         "blocks": [b.block_hash for b in event.blocks] or list(event.block_hashes)})
        return self.indexer.apply_event(event)

    def begin_resync(self, worker_id: WorkerId) -> None:
        """A dump of ``worker_id``'s blocks was asked for: keep its events until it is applied."""
        self._resync.setdefault(worker_id, [])

    def end_resync(self, worker_id: WorkerId) -> None:
        """The dump will not come (worker gone, no recovery endpoint): stop keeping events."""
        self._resync.pop(worker_id, None)

    def apply_dump(self, worker_id: WorkerId, dump: dict[str, Any]) -> int:
        """Replace what we know of ``worker_id``'s cache with its recovery answer (worker_state.py),
        then replay the events newer than the dump.  Returns the number of blocks applied."""
        pending = self._resync.pop(worker_id, [])
        if isinstance(self.indexer, ApproxKvIndexer):
            return 0
        self.indexer.remove_worker(worker_id)
        n = _apply_chains(self.indexer.tree, worker_id, dump.get("blocks") or ())
        for tier, blocks in (dump.get("tiers") or {}).items():
            if tier in LOWER_TIERS:
                n += _apply_chains(self.indexer.tier_tree(tier), worker_id, blocks)
        last = dump.get("last_event_id")
        if last is not None:
            self._dumped_upto[worker_id] = int(last)
        for event in pending:
            if last is None or event.event_id > last:
                self.indexer.apply_event(event)
        return n

    def apply_active_sequence_event(self, message: bytes | str | dict[str, Any]) -> bool:
        """One message of topic ``active_sequences_events`` (replica_sync.py: a batch or one event) from another
        router, ours or 1.6.1's, or from a 1.6.1 worker (its prefill-done marks).  Our own echoes are skipped.
        Returns whether anything in it applied."""
        applied = False
        try:
            if not isinstance(message, dict):
                message = orjson.loads(message)
            assert isinstance(message, dict)
            for ev in sync.read_events(message, self.block_size):
                peer = ev.router_id
                if peer == self.router_id:
                    continue
                request_id, worker, kind = ev.request_id, ev.worker_id, ev.kind
                if kind == sync.ADD:
                    blocks = ev.blocks
                    if ev.isl is not None:  # a router of ours, which sends heartbeats: silence ends its bookings
                        self._peer_seen[peer] = self.clock()
                        if ev.isl % self.block_size:
                            blocks.append(self.rng.getrandbits(64))  # its private partial block, as it books it
                    elif peer in self._peer_seen:
                        self._peer_seen[peer] = self.clock()
                    self._add(request_id, worker, blocks, ev.prefill)
                    if self.homes is not None:
                        self.homes.record(blocks, worker)
                    self._peer_of[request_id] = peer
                    booked = self._peer_booked
                    booked.pop(request_id, None)
                    booked[request_id] = self.clock()
                    applied = True
                elif kind == sync.MARK:
                    applied = self._mark(worker, request_id) or applied
                elif kind == sync.FREE:
                    if peer in self._peer_seen:
                        self._peer_seen[peer] = self.clock()
                    self._peer_of.pop(request_id, None)
                    self._peer_booked.pop(request_id, None)
                    self._owner.pop(request_id, None)
                    self._free(worker, request_id)
                    applied = True
                else:  # a heartbeat: the peer's bookings it no longer lists were freed (a lost Free)
                    self._peer_seen[peer] = self.clock()
                    for rid in [r for r, p in self._peer_of.items() if p == peer and r not in ev.live]:
                        self._free_peer(rid)
                    applied = True
        except (KeyError, TypeError, ValueError, AttributeError, AssertionError, orjson.JSONDecodeError) as e:
            self.seq_events_rejected += 1
            now = time.monotonic()
            if now - self._rejected_logged_at >= 60:
                self._rejected_logged_at = now
                log.warning("malformed active-sequence event(s) skipped (%d so far; at most one line a minute): "
                            "%s: %s", self.seq_events_rejected, type(e).__name__, e)
        return applied

    def heartbeat(self) -> None:
        """Tell peers which of their copies of our bookings are still live (call every peer_ttl / 3)."""
        if self.publish_active_sequence is not None:
            own = [rid for rid in self._owner if rid not in self._peer_of]
            emit(self.publish_active_sequence, sync.heartbeat(self.router_id, own), "router heartbeat")

    def expire_peers(self, now: float | None = None) -> int:
        """Free every booking of a peer router not heard from for ``peer_ttl`` seconds (peers that send
        heartbeats), and those older than 1.x's bound of peers that send none; returns how many."""
        now = self.clock() if now is None else now
        freed = 0
        booked = self._peer_booked
        while booked:
            rid, at = next(iter(booked.items()))
            if now - at <= sync.UNBEATING_BOOKING_S:
                break
            del booked[rid]
            if rid in self._peer_of and self._peer_of[rid] not in self._peer_seen:
                self._free_peer(rid)
                freed += 1
        dead = {p for p, seen in self._peer_seen.items() if now - seen > self.peer_ttl}
        if not dead:
            return freed
        gone = [rid for rid, p in self._peer_of.items() if p in dead]
        for rid in gone:
            self._free_peer(rid)
        for p in dead:
            del self._peer_seen[p]
        log.info("peer router(s) %s silent for %.0f s: freed their %d booking(s)",
                 ", ".join(f"{p:x}" for p in sorted(dead)), self.peer_ttl, len(gone))
        return freed + len(gone)

    def _free_peer(self, request_id: str) -> None:
        self._peer_of.pop(request_id, None)
        self._peer_booked.pop(request_id, None)
        worker = self._owner.pop(request_id, None)
        if worker is not None:
            self._free(worker, request_id)

    def remove_worker(self, worker_id: WorkerId) -> None:
        """A worker left: forget its cached blocks and the requests tracked on it."""
        self.lenders.pop(worker_id, None)
        self.indexer.remove_worker(worker_id)
        self._resync.pop(worker_id, None)
        self._dumped_upto.pop(worker_id, None)
        if self.homes is not None:
            self.homes.forget_worker(worker_id)
        if not self.owns_load:
            return
        tracker = self.trackers.pop(worker_id, None)
        self._loads.remove(worker_id)
        if tracker is not None:
            for head in tracker.heads:
                self._drop_head(head, worker_id)
            for rid in tracker.requests:
                self._owner.pop(rid, None)
                self._peer_of.pop(rid, None)
                self._peer_booked.pop(rid, None)

    # -- queries -------------------------------------------------------------------------------
    def find_matches(self, token_ids: Sequence[int]) -> Overlaps:
        """Cached prefix length, in blocks, of ``token_ids`` per worker."""
        return self.indexer.find_matches(compute_block_hashes(token_ids, self.block_size, self.lora_name))

    def worker_load(self, worker_id: WorkerId) -> dict[str, int]:
        t = self.trackers.get(worker_id)
        if t is None:
            return {"active_blocks": 0, "active_tokens": 0, "active_requests": 0}
        return {"active_blocks": t.active_blocks, "active_tokens": t.active_tokens,
                "active_requests": len(t.requests)}

    def restorable(self, token_ids: Sequence[int]) -> dict[WorkerId, float]:
        """Per worker, the weighted blocks of ``token_ids`` it could restore from a lower tier beyond its
        resident prefix (what :meth:`select` credits)."""
        seq = compute_seq_hashes(compute_block_hashes(token_ids, self.block_size, self.lora_name))
        return self._restorable(self._lower_matches(seq), self.indexer.find_matches([], seq))

    # -- internals -----------------------------------------------------------------------------
    def _log_decision(self, request_id: str | None, worker: WorkerId, isl: int, blocks: Sequence[int | str],
                      costs: Sequence[WorkerCost], fetch_from: tuple[WorkerId, int] | None = None) -> None:
        """One ``route`` line (decision_log.py): what the router saw of each candidate when it chose, and
        the worker it named to fetch the prefix from, with its blocks."""
        assert self.decision_log is not None
        cands: dict[str, Any] = {}
        for c in costs:
            t = self.trackers.get(c.worker_id)
            cands[f"{c.worker_id:x}"] = {
                "overlap": c.overlap_blocks, "inflight": t.shared_prefix(blocks) if t is not None else 0,
                "prefill": c.prefill_tokens, "decode": c.decode_blocks, "logit": round(c.logit, 3),
                "active_tokens": t.active_tokens if t is not None else 0,
                "active_blocks": t.num_blocks if t is not None else 0,
                "requests": len(t.requests) if t is not None else 0}
        self.decision_log.write({"ev": "route", "id": request_id, "worker": f"{worker:x}", "isl": isl,
                                 "blocks": list(blocks[:isl // self.block_size]),
                                 "candidates": cands,
                                 **({"fetch": {"from": f"{fetch_from[0]:x}", "blocks": fetch_from[1]}}
                                    if fetch_from is not None else {})})

    def _lower_matches(self, seq: Sequence[int]) -> dict[str, Overlaps] | None:
        """The prompt's matches per lower tier (None: the approximate indexer, which has no tiers)."""
        return None if isinstance(self.indexer, ApproxKvIndexer) else self.indexer.find_lower_matches(seq)

    def _restorable(self, lower: Mapping[str, Overlaps] | None, overlaps: Overlaps) -> dict[WorkerId, float]:
        """Blocks past each worker's resident prefix that it holds offloaded (``lower``: the prompt's
        matches per lower tier), each counted at its tier's weight (a block reachable through host memory
        is priced as host, through disk as disk)."""
        if not lower:
            return {}
        credit: dict[WorkerId, float] = {}
        for w in set().union(*(scores.keys() for scores in lower.values())):
            reached = overlaps.get(w, 0)
            c = 0.0
            for tier in LOWER_TIERS:
                n = lower.get(tier, {}).get(w, 0)
                if n > reached:
                    c += self.tier_weights.get(tier, 0.0) * (n - reached)
                    reached = n
            if c > 0:
                credit[w] = c
        return credit

    def _best_lender(self, overlaps: Overlaps, lower: Mapping[str, Overlaps] | None) -> tuple[WorkerId, int, float] | None:
        """The lending worker holding most of the prompt, in its cache or its host-memory tier (it lends
        from both), how many blocks, and what a fetched block is worth there (``prefix_fetch_weight``;
        times the host tier's weight for blocks the holder would load from its host memory itself: a fetch
        of them is never cheaper than the holder's own restore).  None: no fetch is worth it."""
        lenders = self.lenders
        host = (lower or {}).get(HOST) or {}
        if self.prefix_fetch_weight <= 0 or len(lenders) < 2 or not (overlaps or host):
            return None
        best: tuple[WorkerId, int, float] | None = None
        weight = self.prefix_fetch_weight
        for held, w_factor in ((overlaps, weight), (host, weight * self.tier_weights.get(HOST, 0.0))):
            for w, n in held.items():
                if n >= PREFIX_FETCH_MIN_BLOCKS and w in lenders and (best is None or n > best[1]):
                    best = (w, n, w_factor)
        return best

    def _fetchable(self, holder: tuple[WorkerId, int, float], overlaps: Overlaps,
                   restorable: dict[WorkerId, float], now: float,
                   seq: Sequence[int]) -> tuple[dict[WorkerId, float], set[WorkerId]]:
        """``restorable`` with every other lender credited with the blocks it could fetch from ``holder``
        past its own prefix, at the holder's weight, less the wait for the holder's next step boundary (it
        exports its cache between two steps: what is left of the prefill it is computing, in blocks) unless
        its host-memory tier holds all of them (served from there at once: a lender keeps each finished
        sequence there).  A credit that does not beat the worker's own offloaded blocks leaves them.
        Returns the credits and the workers credited with a fetch."""
        credit = dict(restorable)
        fetchers: set[WorkerId] = set()
        best, held, weight = holder
        tracker = self.trackers.get(best)
        if tracker is None or tracker.pending_tokens(now) <= 0:
            # a holder with no prompt to compute (idle, or only decoding) delays a prompt sent to it by a
            # token per step; a fetch costs more than that (tens of ms and a load): only a holder with
            # a prefill ahead lends.  (Fetching from decoding holders too, the median TTFT in the peers
            # benchmark was 1.01-1.42x that of not fetching at all.)
            return credit, fetchers
        wait = tracker.current_prefill_left(now) / self.block_size
        if wait > 0 and isinstance(self.indexer, KvIndexer) and self.indexer.find_tier_matches(HOST, seq).get(best, 0) >= held:
            wait = 0.0  # all of it in the holder's host tier, which it lends from without its engine
        for w in self.lenders:
            gain = held - overlaps.get(w, 0)
            if w != best and gain >= PREFIX_FETCH_MIN_BLOCKS:
                c = weight * gain - wait
                if c > credit.get(w, 0.0):
                    credit[w] = c
                    fetchers.add(w)
        return credit, fetchers

    def _request_blocks(self, seq_hashes: list[int], isl: int) -> list[int]:
        if isl % self.block_size:
            # the partial tail is private to the request: a random name nobody else will share
            return seq_hashes + [self.rng.getrandbits(64)]
        return seq_hashes

    def _add(self, request_id: str, worker: WorkerId, blocks: Sequence[int], prefill: int) -> None:
        old = self._owner.get(request_id)
        if old is not None and old != worker:
            self._free(old, request_id)
        self._owner[request_id] = worker
        tracker = self.trackers.get(worker)
        if tracker is None:
            tracker = self.trackers[worker] = ActiveSequences()
        if request_id in tracker.requests:
            self._free(worker, request_id)
        tracker.add_request(request_id, blocks, prefill, self.clock())
        if blocks:
            self._heads.setdefault(blocks[0], set()).add(worker)
        self._loads.update(worker, tracker)

    def _mark(self, worker: WorkerId, request_id: str) -> bool:
        tracker = self.trackers.get(worker)
        if tracker is None or not tracker.mark_prefill_completed(request_id, self.clock()):
            return False
        self._loads.update(worker, tracker)
        return True

    def _free(self, worker: WorkerId, request_id: str) -> None:
        tracker = self.trackers.get(worker)
        if tracker is None:
            return
        req = tracker.requests.get(request_id)
        if req is None or not tracker.free(request_id):
            return
        if req.blocks and req.blocks[0] not in tracker.heads:
            self._drop_head(req.blocks[0], worker)
        self._loads.update(worker, tracker)

    def _drop_head(self, head: int | str, worker: WorkerId) -> None:
        workers = self._heads.get(head)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._heads[head]


def _track_router(router: KvRouter) -> None:
    """Its structures in dynamo.bounds (``/debug/memory``): per request (back to 0 when idle), per worker,
    and the index, bounded by what the workers hold (it shrinks with their ``removed`` events)."""
    if router.owns_load:  # (a LoRA adapter's router shares these with its base model's)
        track("kv_router_requests", router, lambda r: len(r._owner))
        track("kv_router_peer_requests", router, lambda r: len(r._peer_of))
        track("kv_router_peer_booked", router, lambda r: len(r._peer_booked))
        track("kv_router_request_heads", router, lambda r: len(r._heads))
        track("kv_router_tracked_requests", router, lambda r: sum(len(t.requests) for t in r.trackers.values()))
    track("kv_router_resync_events", router, lambda r: sum(len(v) for v in r._resync.values()))
    track("kv_index_blocks", router, lambda r: r.indexer.block_count())
    track("kv_index_bytes", router, lambda r: r.indexer.memory_bytes())


def _apply_chains(tree: Any, worker_id: WorkerId, rows: Iterable[Sequence[Any]]) -> int:
    """Store a dump's ``[block_hash, tokens_hash, parent]`` rows (parents first) in ``tree``, one
    ``apply_stored`` per chain; returns the blocks applied."""
    n = 0
    chain: list[StoredBlock] = []
    chain_parent: int | None = None
    for h, tokens_hash, parent in rows:
        if chain and parent == chain[-1].block_hash:
            chain.append(StoredBlock(int(h), int(tokens_hash)))
            continue
        if chain:
            n += len(chain) if tree.apply_stored(worker_id, chain_parent, chain) else 0
        chain, chain_parent = [StoredBlock(int(h), int(tokens_hash))], parent
    if chain:
        n += len(chain) if tree.apply_stored(worker_id, chain_parent, chain) else 0
    return n

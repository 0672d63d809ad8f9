#!/usr/bin/env python3
"""The KV router at scale, with no network: how fast the indexer applies KV events, and how long one
routing decision takes with many workers, many cached blocks and requests in flight.

    .venv/bin/python -m benchmarks.router.scale                                  # 1,000 workers x 10k blocks
    .venv/bin/python -m benchmarks.router.scale --workers 100 --blocks-per-worker 100000
    .venv/bin/python -m benchmarks.router.scale --profile decide                 # cProfile of the decisions

**The cache.**  ``--groups`` shared prefixes (system prompts) of ``--prefix-blocks`` blocks each; every
worker holds ``--groups-per-worker`` of them (a group's prefix is on about workers x groups-per-worker /
groups workers, as KV routing keeps a group on few workers) and, under them, conversation histories of
``--history-blocks`` blocks of its own, until it holds ``--blocks-per-worker`` blocks.  Workers build
their cache through ``stored`` events of ``--event-blocks`` blocks each (an engine's event for one
scheduler step), exactly as the frontend receives them over NATS: JSON bytes.

**Events/s.**  Block events (a stored block or a removed hash counts one) per second of
``KvIndexer.apply_event``: from JSON bytes (parse + apply: what the frontend does per NATS message) and
from parsed events (apply alone); then removing a tenth of every worker's histories (evictions).

**Decisions.**  A :class:`KvRouter` (block size ``--block-size``, the default overlap weight) on top of
that index, with ``--in-flight`` requests booked per worker (4k-token prompts, half of them past their
prefill).  Each decision is ``KvRouter.select(token_ids, all workers, request_id)`` for a prompt of
``--isl`` tokens: a group's prefix, then (for half of the prompts) a history some worker holds, then new
tokens; hashing the prompt included.  The request is freed after each decision (untimed), so the load
stays the same.  p50 / p99 / max over ``--decisions``, in wall time and in the thread's CPU time (which
leaves out the time the process waited for a core: on a shared machine the wall-time p99 is mostly
that); the parts (hashing, ``find_matches``, the costs and
the pick) are timed separately as well.

Figures depend on the machine and its load: run it alone, repeat, compare within one run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import random
import resource
import statistics
import time
from pathlib import Path

import orjson

from dynamo.kv import KvRouter
from dynamo.kv.events import kv_event, parse_kv_event, removed_data, stored_data
from dynamo.kv.hashing import (
    compute_block_hashes,
    compute_hashes,
    compute_hashes_async,
    compute_seq_hashes,
)
from dynamo.kv.scheduler import (
    FAST_PICK_MIN_WORKERS,
    compute_costs,
    fast_pick,
    select_worker,
)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def index_mb(router: KvRouter) -> float:
    """The index's own memory: its tables and worker sets, as the C core counts them."""
    return router.indexer.tree.memory_bytes() / 2**20


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Cache:
    """The synthetic cache: group prefixes (with their tokens) and per-worker histories (some with tokens)."""

    def __init__(self, args: argparse.Namespace, rng: random.Random):
        bs = args.block_size
        self.bs = bs
        self.groups = []  # (tokens, local hashes, sequence hashes)
        for _ in range(args.groups):
            toks = [rng.randrange(1, 100_000) for _ in range(args.prefix_blocks * bs)]
            local = compute_block_hashes(toks, bs)
            self.groups.append((toks, local, compute_seq_hashes(local)))
        self.events: list[bytes] = []  # stored events, JSON, in the order the workers send them
        self.histories: dict[int, list[tuple[int, list[int]]]] = {}  # worker -> (group, history seq hashes)
        self.with_tokens: list[tuple[int, int, list[int]]] = []  # (worker, group, history tokens): for prompts
        self.block_events = 0
        eid = 0
        token_budget = args.token_histories
        for w in range(args.workers):
            wid = 10_000 + w
            groups = rng.sample(range(args.groups), args.groups_per_worker)
            held = 0
            hist: list[tuple[int, list[int]]] = []
            for g in groups:
                _, local, seq = self.groups[g]
                eid += 1
                self.events += self._chunks(wid, None, list(zip(seq, local, strict=True)), args.event_blocks)
                held += len(seq)
            i = 0
            while held < args.blocks_per_worker:
                g = groups[i % len(groups)]
                i += 1
                n = min(args.history_blocks, args.blocks_per_worker - held)
                if token_budget > 0:  # a history with real tokens, which a prompt can continue
                    toks = [rng.randrange(1, 100_000) for _ in range(n * bs)]
                    local = compute_block_hashes(toks, bs)
                    self.with_tokens.append((wid, g, toks))
                    token_budget -= 1
                else:  # hashes only (cheaper to make; they fill the cache)
                    local = [rng.getrandbits(64) for _ in range(n)]
                seq = compute_seq_hashes(local, self.groups[g][2][-1])
                self.events += self._chunks(wid, self.groups[g][2][-1], list(zip(seq, local, strict=True)), args.event_blocks)
                hist.append((g, seq))
                held += n
            self.histories[wid] = hist

    def _chunks(self, wid: int, parent: int | None, blocks: list[tuple[int, int]], size: int) -> list[bytes]:
        out = []
        for i in range(0, len(blocks), size):
            chunk = blocks[i:i + size]
            out.append(orjson.dumps(kv_event(wid, 0, stored_data(parent, chunk))))
            parent = chunk[-1][0]
            self.block_events += len(chunk)
        return out


def bench_events(args: argparse.Namespace, cache: Cache, router: KvRouter) -> dict[str, float]:
    gc.collect()
    gc.disable()  # as a long-lived frontend would mostly see: the tree is old-generation data
    try:
        half = len(cache.events) // 2
        t0 = time.perf_counter()
        apply = router.indexer.apply_event
        for raw in cache.events[:half]:
            apply(raw)
        t1 = time.perf_counter()
        raw_blocks = sum(len(orjson.loads(e)["event"]["data"]["stored"]["blocks"]) for e in cache.events[:half])
        parsed = [parse_kv_event(e) for e in cache.events[half:]]
        parsed_blocks = sum(len(p.blocks) for p in parsed)
        t2 = time.perf_counter()
        for ev in parsed:
            apply(ev)
        t3 = time.perf_counter()
        # evictions: a tenth of each worker's histories, newest blocks first (as an LRU would, roughly)
        removals = []
        for wid, hist in cache.histories.items():
            for _g, seq in hist[: max(1, len(hist) // 10)]:
                for i in range(len(seq), 0, -args.event_blocks):
                    removals.append(parse_kv_event(orjson.dumps(kv_event(wid, 0, removed_data(seq[max(0, i - args.event_blocks):i])))))
        removed_blocks = sum(len(r.block_hashes) for r in removals)
        t4 = time.perf_counter()
        for ev in removals:
            apply(ev)
        t5 = time.perf_counter()
    finally:
        gc.enable()
    assert router.indexer.events_rejected == 0, router.indexer.events_rejected
    return {
        "stored_json_blocks_per_s": raw_blocks / (t1 - t0),
        "stored_parsed_blocks_per_s": parsed_blocks / (t3 - t2),
        "removed_parsed_blocks_per_s": removed_blocks / (t5 - t4),
        "stored_blocks": raw_blocks + parsed_blocks,
        "removed_blocks": removed_blocks,
    }


def prompts(args: argparse.Namespace, cache: Cache, rng: random.Random) -> list[list[int]]:
    isl = args.isl
    out = []
    for i in range(args.decisions):
        if i % 2 == 0 and cache.with_tokens:
            _, g, hist = rng.choice(cache.with_tokens)
            toks = cache.groups[g][0] + hist
        else:
            toks = list(rng.choice(cache.groups)[0])
        toks = toks[:isl] + [rng.randrange(1, 100_000) for _ in range(max(0, isl - len(toks)))]
        out.append(toks)
    return out


def book_in_flight(args: argparse.Namespace, cache: Cache, router: KvRouter, rng: random.Random) -> None:
    """``--in-flight`` requests per worker, booked where they were routed (add_request: no decision)."""
    n = 0
    for wid in cache.histories:
        for _ in range(args.in_flight):
            g = rng.randrange(len(cache.groups))
            toks = cache.groups[g][0] + [rng.randrange(1, 100_000) for _ in range(args.isl - len(cache.groups[g][0]))]
            rid = f"bg-{n}"
            n += 1
            router.add_request(rid, toks, wid, overlap_blocks=args.prefix_blocks)
            if n % 2:
                router.on_first_token(rid)


def bench_decisions(args: argparse.Namespace, cache: Cache, router: KvRouter, rng: random.Random,
                    profile: bool) -> dict[str, float]:
    workers = list(cache.histories)
    ps = prompts(args, cache, rng)
    times, cpu, hashing, matching, costing, overlaps = [], [], [], [], [], []
    prof = cProfile.Profile() if profile else None
    gc.collect()
    for i, toks in enumerate(ps):
        rid = f"d-{i}"
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        d = router.select(toks, workers, request_id=rid)
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        overlaps.append(d.overlap_blocks)
        router.on_finished(rid)
    # the parts, on the same prompts
    for toks in ps[: min(len(ps), 300)]:
        t0 = time.perf_counter()
        local = compute_block_hashes(toks, router.block_size)
        seq = compute_seq_hashes(local)
        t1 = time.perf_counter()
        ov = router.indexer.find_matches(local)
        t2 = time.perf_counter()
        blocks = router._request_blocks(seq, len(toks))
        if len(workers) >= FAST_PICK_MIN_WORKERS:  # what select() does with this many workers
            fast_pick(workers, ov, blocks, len(toks), router.block_size, router.overlap_score_weight,
                      router.trackers, router._heads, router._loads, router.rng)
        else:
            costs = compute_costs(workers, ov, blocks, len(toks), router.block_size, router.overlap_score_weight,
                                  router.trackers)
            select_worker(costs, 0.0, router.rng)
        t3 = time.perf_counter()
        hashing.append(t1 - t0)
        matching.append(t2 - t1)
        costing.append(t3 - t2)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    ms = 1e3
    return {
        "decision_p50_ms": pct(times, 0.5) * ms, "decision_p99_ms": pct(times, 0.99) * ms,
        "decision_max_ms": max(times) * ms, "decision_mean_ms": statistics.fmean(times) * ms,
        "decision_cpu_p50_ms": pct(cpu, 0.5) * ms, "decision_cpu_p99_ms": pct(cpu, 0.99) * ms,
        "hash_p50_ms": pct(hashing, 0.5) * ms, "find_matches_p50_ms": pct(matching, 0.5) * ms,
        "find_matches_p99_ms": pct(matching, 0.99) * ms,
        "costs_p50_ms": pct(costing, 0.5) * ms, "costs_p99_ms": pct(costing, 0.99) * ms,
        "mean_overlap_blocks": statistics.fmean(overlaps),
    }


def bench_long_prompts(block_size: int, repeats: int = 5) -> dict[str, float]:
    """Hashing 32k- and 128k-token prompts: in one piece (what would hold the loop if done at once), and
    in slices (compute_hashes_async, as the frontend does for 8k tokens or more): the longest the event
    loop waited for its next turn meanwhile.  Both in the thread's CPU time (a busy machine preempts the
    process at any point, which no code can avoid) and, for the slices, in wall time too."""
    import asyncio

    out: dict[str, float] = {}
    for n in (32 * 1024, 128 * 1024):
        toks = [(i * 7919) % 100_000 for i in range(n)]
        whole = []
        for _ in range(repeats):
            t0 = time.thread_time()
            compute_hashes(toks, block_size)
            whole.append(time.thread_time() - t0)

        async def sliced(toks: list[int]) -> tuple[float, float]:
            cpu_gaps: list[float] = []
            wall_gaps: list[float] = []
            done = False

            async def ticker() -> None:
                c, w = time.thread_time(), time.perf_counter()
                while not done:
                    await asyncio.sleep(0)
                    c2, w2 = time.thread_time(), time.perf_counter()
                    cpu_gaps.append(c2 - c)
                    wall_gaps.append(w2 - w)
                    c, w = c2, w2

            t = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            await compute_hashes_async(toks, block_size)
            done = True
            await t
            return max(cpu_gaps), max(wall_gaps)

        held = [asyncio.run(sliced(toks)) for _ in range(repeats)]
        out[f"hash_{n // 1024}k_whole_cpu_ms"] = min(whole) * 1e3
        out[f"hash_{n // 1024}k_slice_max_cpu_ms"] = min(h[0] for h in held) * 1e3
        out[f"hash_{n // 1024}k_slice_max_wall_ms"] = min(h[1] for h in held) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks-per-worker", type=int, default=10_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--isl", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--groups-per-worker", type=int, default=4)
    ap.add_argument("--prefix-blocks", type=int, default=64, help="blocks of a group's shared prefix")
    ap.add_argument("--history-blocks", type=int, default=192)
    ap.add_argument("--event-blocks", type=int, default=16, help="blocks per stored event")
    ap.add_argument("--token-histories", type=int, default=2000, help="histories made of real tokens")
    ap.add_argument("--in-flight", type=int, default=4, help="requests booked per worker")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", choices=["events", "decide"], default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    rss0 = rss_mb()
    t0 = time.perf_counter()
    cache = Cache(args, rng)
    print(f"workload: {args.workers} workers x {args.blocks_per_worker} blocks ({cache.block_events:,} block events "
          f"in {len(cache.events):,} stored events), built in {time.perf_counter() - t0:.1f} s", flush=True)
    router = KvRouter(block_size=args.block_size, overlap_score_weight=2.0, seed=args.seed)
    rss1 = rss_mb()
    if args.profile == "events":
        prof = cProfile.Profile()
        prof.enable()
    ev = bench_events(args, cache, router)
    if args.profile == "events":
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    nodes = router.indexer.tree.node_count()
    rss2 = rss_mb()
    imb = index_mb(router)
    pairs = sum(router.indexer.tree.num_blocks(w) for w in router.indexer.tree.workers())
    cache.events = []  # the raw events are no longer needed
    book_in_flight(args, cache, router, rng)
    # the benchmark's own data (prompts, histories) out of the collector's way: a frontend has none of it
    gc.collect()
    gc.freeze()
    dec = bench_decisions(args, cache, router, rng, args.profile == "decide")
    out = {"args": vars(args) | {"json": str(args.json) if args.json else None}, "events": ev, "decisions": dec,
           "tree_nodes": nodes, "index_mb": imb, "worker_blocks": pairs, "rss_mb": {"start": rss0, "workload": rss1, "indexed": rss2},
           "python": platform.python_version(), "machine": platform.machine()}
    print(f"indexer: stored from JSON {ev['stored_json_blocks_per_s'] / 1e6:.2f} M block events/s, "
          f"parsed {ev['stored_parsed_blocks_per_s'] / 1e6:.2f} M/s, removed {ev['removed_parsed_blocks_per_s'] / 1e6:.2f} M/s; "
          f"{nodes:,} distinct blocks, {pairs:,} (worker, block) pairs; index about {imb:,.0f} MB "
          f"({imb * 2**20 / max(1, pairs):.0f} B per pair); max RSS {rss2:,.0f} MB (workload {rss1:,.0f} MB)")
    print(f"decision ({args.isl} tokens, {args.workers} workers, {args.in_flight} in flight each): "
          f"p50 {dec['decision_p50_ms']:.3f} ms, p99 {dec['decision_p99_ms']:.3f} ms, max {dec['decision_max_ms']:.3f} ms "
          f"(CPU time p50 {dec['decision_cpu_p50_ms']:.3f}, p99 {dec['decision_cpu_p99_ms']:.3f} ms); "
          f"parts p50: hash {dec['hash_p50_ms']:.3f}, find_matches {dec['find_matches_p50_ms']:.3f} "
          f"(p99 {dec['find_matches_p99_ms']:.3f}), costs+pick {dec['costs_p50_ms']:.3f} (p99 {dec['costs_p99_ms']:.3f}) ms; "
          f"mean overlap {dec['mean_overlap_blocks']:.1f} blocks")
    lp = bench_long_prompts(args.block_size)
    out["long_prompts"] = lp
    for k in (32, 128):
        print(f"hashing a {k}k-token prompt (block size {args.block_size}, best of 5): "
              f"{lp[f'hash_{k}k_whole_cpu_ms']:.2f} ms CPU in one piece; in slices the loop waited at most "
              f"{lp[f'hash_{k}k_slice_max_cpu_ms']:.2f} ms CPU ({lp[f'hash_{k}k_slice_max_wall_ms']:.2f} ms wall)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

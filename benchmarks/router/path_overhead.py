#!/usr/bin/env python3
"""What each fleet's path adds to a request on one idle llama.cpp engine, before any routing matters:
ours (``in=http out=dyn --router-mode kv`` + one ``in=dyn://`` worker, etcd and NATS), the ``dynamo-run
in=http out=llamacpp`` server alone (what the peer routers front), and vllm-router in front of it.

    PYTHONPATH=src .venv/bin/python -m benchmarks.router.path_overhead [--requests 12] [--rounds 3]

Streaming chat requests one after the other, time to the first content chunk: ``cached`` sends the same
prompt every time (all of it cached after the first), ``new`` a new question after the same system prompt
(the question computed).  The first two of each series are left out (warm-up).  Rounds alternate the
paths, so a load swing falls on all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.router import peers
from benchmarks.router import run as router_run
from harness.proc import DynamoRun, DynamoWorker, free_port
from harness.servers import etcd_and_nats_env

MODEL = "tiny-chat"
SYSTEM = "You are a helpful assistant for a shop. " * 20


async def series(base: str, n: int, new_questions: bool) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n):
            user = f"Question number {i}: what about item {i * 7}?" if new_questions else "Hello there"
            body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "max_tokens": 4, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
                seen = False
                async for line in resp.aiter_lines():
                    if not seen and line.startswith("data: {") and '"content"' in line:
                        out.append(time.perf_counter() - t0)
                        seen = True
            await asyncio.sleep(0.05)
    return out[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gguf = router_run.smollm2_gguf()
    extra = Path(tempfile.mkdtemp()) / "engine.json"
    extra.write_text(json.dumps({"n_parallel": 4, "n_threads": 1}))
    venv = peers.peers_venv(peers.DEFAULT_VENV)
    direct = DynamoRun("out=llamacpp", str(gguf), "--context-length", "1024", "--model-name", MODEL,
                       "--extra-engine-args", str(extra), env={"DYN_FILE_KV": tempfile.mkdtemp()}, startup_timeout=120)
    direct.start()
    port, prometheus = free_port(), free_port()
    log = Path(tempfile.mkdtemp()) / "vllm-router.log"
    router = subprocess.Popen(peers.peer_command("vllm", venv, [direct.base_url], port, prometheus),
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        peers.wait_ready(port, 1, router, log)
        with etcd_and_nats_env() as servers:
            worker = DynamoWorker("in=dyn://overhead.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name",
                                  MODEL, "--context-length", "1024", "--extra-engine-args", str(extra), env=servers,
                                  startup_timeout=120)
            worker.start()
            frontend = DynamoRun("out=dyn", "--router-mode", "kv", env=servers, startup_timeout=60)
            frontend.start()
            try:
                peers.serves_model(frontend.base_url, MODEL)
                paths = {"ours": frontend.base_url, "in=http alone": direct.base_url,
                         "vllm-router": f"http://127.0.0.1:{port}"}
                got: dict[str, dict[str, list[float]]] = {k: {"cached": [], "new": []} for k in paths}
                for _ in range(args.rounds):
                    for name, base in paths.items():
                        for kind in ("cached", "new"):
                            got[name][kind] += asyncio.run(series(base, args.requests, kind == "new"))
                for name, kinds in got.items():
                    print(f"{name:14s} " + "   ".join(
                        f"{kind}: p50 {1e3 * statistics.median(xs):.1f} mean {1e3 * statistics.mean(xs):.1f} ms"
                        f" (n={len(xs)})" for kind, xs in kinds.items()))
            finally:
                frontend.stop()
                worker.stop()
    finally:
        router.terminate()
        router.wait(10)
        direct.stop()


if __name__ == "__main__":
    main()

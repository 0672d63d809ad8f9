#!/usr/bin/env python3
"""Streaming load generator for OpenAI-compatible /v1/chat/completions servers.

C concurrent streams each send `stream: true` chat requests in a loop, for D seconds
(`--duration`) or until R requests in total were sent (`--requests`). Every SSE event
carrying a non-empty `delta.content` counts as one token (the echo engines emit one
character per chunk).

Per request it records the time to first token (TTFT, from just before connecting or
writing the request to the arrival of the first content chunk) and the gaps between
consecutive content chunks (inter-token latency, ITL, as seen by the client: chunks that
arrive in the same socket read get a gap of 0).

It reports requests, aggregate tokens/s, TTFT p50/p99, ITL p50/p99, errors, and the
CPU seconds used by the server process tree (utime+stime from /proc/<pid>/stat, for
`--pid` and its live descendants), by this client, and by the whole machine.

Two client implementations (same measurement logic; both in benchmarks/sse_client.py):
  raw      (default) one asyncio.Protocol per connection, a minimal HTTP/1.1 + chunked
           decoder, TCP_NODELAY; the cheapest on CPU, which matters because the client
           shares the machine's cores with the server.
  aiohttp  aiohttp.ClientSession, `resp.content.iter_any()`.
Two parsers:
  scan     (default) counts `"content":"` in complete SSE events (bytes.count).
  json     orjson-decodes every `data:` event; `--verify-echo` then checks the streamed
           text equals the prompt (for echo engines).
Connections: keep-alive (default; one connection per stream, reused) or `--fresh`
(a new connection per request).

Usage:
  python -m benchmarks.loadgen --url http://127.0.0.1:8080 --model M -c 256 -d 20 --pid PID
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import time
from typing import Any

from benchmarks.sse_client import AiohttpClient, RawClient, RequestState, Stats

_WORDS = (
    "the quick brown fox jumps over lazy dog while seven wizards quietly pack boxes "
    "of liquor jugs near a river bank under bright morning light and distant hills echo "
    "with songs about time space energy matter code data model token stream server client"
).split()


def make_prompt(n_words: int, seed: int = 1234) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def pct(values, q: float) -> float | None:
    """Percentile (linear interpolation) in the same unit as values; None when empty."""
    if not len(values):
        return None
    try:
        import numpy as np

        return float(np.percentile(np.asarray(values, dtype=np.float64), q))
    except ImportError:  # pragma: no cover
        s = sorted(values)
        k = (len(s) - 1) * q / 100.0
        f = int(k)
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)


# ----------------------------------------------------------------------------- CPU accounting

_CLK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15
    return (int(fields[11]) + int(fields[12])) / _CLK


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """utime+stime (s) of pid and its live descendants, by pid."""
    kids = _children_map()
    out: dict[int, float] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        v = _proc_cpu(p)
        if v is not None:
            out[p] = v
        stack.extend(kids.get(p, ()))
    return out


def tree_write_calls(pid: int) -> int | None:
    """Write-family system calls (``syscw`` of /proc/<pid>/io: write, writev...; how both servers send
    on a socket) of pid and its live descendants; None where /proc does not say."""
    kids = _children_map()
    total, seen, stack = 0, False, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/io", "rb") as f:
                for line in f:
                    if line.startswith(b"syscw:"):
                        total += int(line.split()[1])
                        seen = True
        except OSError:
            pass
        stack.extend(kids.get(p, ()))
    return total if seen else None


def tree_rss_kib(pid: int) -> int:
    total = 0
    kids = _children_map()
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
        stack.extend(kids.get(p, ()))
    return total


def machine_cpu() -> tuple[float, float]:
    """(busy seconds, total seconds) summed over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts[:8]]
    idle = vals[3] + vals[4]
    return (sum(vals) - idle) / _CLK, sum(vals) / _CLK


def client_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- stats




# ----------------------------------------------------------------------------- driver


async def run_load(
    url: str,
    model: str,
    concurrency: int = 16,
    duration: float | None = 20.0,
    requests: int | None = None,
    prompt_words: int = 200,
    max_tokens: int | None = None,
    fresh: bool = False,
    client: str = "raw",
    parse: str = "scan",
    verify_echo: bool = False,
    server_pid: int | None = None,
    timeout: float = 300.0,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``extra_body``: more fields of every request (e.g. ``ignore_eos``)."""
    prompt = make_prompt(prompt_words)
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        **(extra_body or {}),
    }
    if max_tokens:
        payload["max_tokens"] = max_tokens
    body = json.dumps(payload).encode()
    stats = Stats()
    json_mode = parse == "json"
    if verify_echo and not json_mode:
        raise ValueError("--verify-echo needs --parse json")

    on_done = None
    if verify_echo:
        def on_done(req: RequestState) -> None:
            if "".join(req.text) != prompt:
                stats.verify_failures += 1
                stats.error("echo_mismatch", "".join(req.text)[:120])

    remaining = [requests if requests is not None else -1]
    stopping = [False]

    def next_ticket() -> bool:
        if stopping[0]:
            return False
        if remaining[0] < 0:
            return True
        if remaining[0] == 0:
            return False
        remaining[0] -= 1
        return True

    if client == "raw":
        cl = RawClient(url, fresh)
        reqbytes = cl.build_request(body)
        mk = lambda: cl.worker(reqbytes, stats, json_mode, next_ticket, timeout, on_done)  # noqa: E731
        closer = None
    elif client == "aiohttp":
        cl = AiohttpClient(url, fresh, concurrency)
        await cl.open()
        mk = lambda: cl.worker(body, stats, json_mode, next_ticket, timeout, on_done)  # noqa: E731
        closer = cl.close
    else:
        raise ValueError(f"unknown client {client!r}")

    srv0 = tree_cpu_seconds(server_pid) if server_pid else {}
    w0 = tree_write_calls(server_pid) if server_pid else None
    m0 = machine_cpu()
    c0 = client_cpu()
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(mk()) for _ in range(concurrency)]
    if requests is None:
        done, pending = await asyncio.wait(tasks, timeout=duration)
        stopping[0] = True
        t_end = time.perf_counter()
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    else:
        await asyncio.gather(*tasks, return_exceptions=True)
        t_end = time.perf_counter()
    elapsed = t_end - t0
    c1 = client_cpu()
    m1 = machine_cpu()
    srv1 = tree_cpu_seconds(server_pid) if server_pid else {}
    w1 = tree_write_calls(server_pid) if server_pid else None
    rss = tree_rss_kib(server_pid) if server_pid else None
    if closer:
        await closer()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            stats.error("worker_crash", repr(t.exception()))

    server_cpu = None
    if server_pid:
        # processes that exited in between are not counted (their time is lost to us)
        server_cpu = sum(v - srv0.get(p, 0.0) for p, v in srv1.items())
    ms = 1e3
    return {
        "config": {
            "url": url, "model": model, "concurrency": concurrency, "duration_s": duration,
            "requests": requests, "prompt_words": prompt_words, "prompt_chars": len(prompt),
            "max_tokens": max_tokens, "connections": "fresh" if fresh else "keep-alive",
            "client": client, "parse": parse,
        },
        "elapsed_s": elapsed,
        "requests_ok": stats.requests_ok,
        "requests_started": stats.requests_started,
        "requests_aborted_at_end": stats.requests_aborted,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / elapsed if elapsed > 0 else 0.0,
        "requests_per_s": stats.requests_ok / elapsed if elapsed > 0 else 0.0,
        "ttft_ms": {"p50": _scale(pct(stats.ttft, 50), ms), "p90": _scale(pct(stats.ttft, 90), ms),
                    "p99": _scale(pct(stats.ttft, 99), ms), "max": _scale(max(stats.ttft, default=None), ms),
                    "n": len(stats.ttft)},
        "itl_ms": {"p50": _scale(pct(stats.itl, 50), ms), "p90": _scale(pct(stats.itl, 90), ms),
                   "p99": _scale(pct(stats.itl, 99), ms), "max": _scale(max(stats.itl, default=None), ms),
                   "mean": _scale(sum(stats.itl) / len(stats.itl) if stats.itl else None, ms),
                   "n": len(stats.itl),
                   # share of tokens that arrived in the same socket read as the previous one
                   "coalesced_frac": (stats.itl.count(0.0) / len(stats.itl)) if stats.itl else None,
                   # gaps of 30 ms or more (a delayed-ACK stall is ~40 ms)
                   "stalls_ge_30ms": sum(1 for g in stats.itl if g >= 0.030)},
        "tokens_per_request_mean": (sum(stats.tokens_per_request) / len(stats.tokens_per_request)
                                    if stats.tokens_per_request else None),
        "errors": sum(stats.errors.values()),
        "errors_by_kind": stats.errors,
        "error_samples": stats.error_samples,
        "server_cpu_s": server_cpu,
        # everything the server tree has used since it started, as read at the end of the run
        "server_cpu_total_s": sum(srv1.values()) if server_pid else None,
        "server_write_calls": (w1 - w0) if w0 is not None and w1 is not None else None,
        "server_cpu_util": (server_cpu / elapsed) if server_cpu is not None and elapsed > 0 else None,
        "server_rss_mib_end": rss / 1024 if rss is not None else None,
        "client_cpu_s": c1 - c0,
        "machine_cpu_busy_s": m1[0] - m0[0],
        "machine_cpu_total_s": m1[1] - m0[1],
        "machine_cpus": os.cpu_count(),
    }


def _scale(v, k):
    return None if v is None else v * k


@contextlib.contextmanager
def batch_policy(enabled: bool = True) -> Any:
    """Run the calling thread (this client) as SCHED_BATCH for the duration.

    Why: on a 2-core machine the client shares the server's cores. A loopback ``send`` wakes the
    client with a "sync" wake-up, which puts it on the sender's core, and the woken client preempts a
    single-threaded server after nearly every token: measured, 3,300 involuntary context switches a
    second in our server at 64 paced streams, and 27 % of its CPU per token (two Python processes
    evicting each other's caches); the original (Rust, a thread pool, a small working set) shows no
    difference. A SCHED_BATCH task does not preempt on wake-up, so the client then runs beside the
    server as a client on another machine would. Off by default; the harnesses' ``--client-batch``.
    """
    if not enabled or not hasattr(os, "SCHED_BATCH"):
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def format_result(r: dict[str, Any]) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    c = r["config"]
    lines = [
        f"concurrency={c['concurrency']} prompt_words={c['prompt_words']} ({c['prompt_chars']} chars) "
        f"connections={c['connections']} client={c['client']} parse={c['parse']}",
        f"elapsed {r['elapsed_s']:.2f}s  requests ok {r['requests_ok']} (started {r['requests_started']}, "
        f"cut at end {r['requests_aborted_at_end']})  errors {r['errors']} {r['errors_by_kind'] or ''}",
        f"tokens {r['tokens']}  tokens/s {r['tokens_per_s']:.0f}  req/s {r['requests_per_s']:.2f}",
        f"TTFT ms p50 {f(r['ttft_ms']['p50'], '.2f')} p99 {f(r['ttft_ms']['p99'], '.2f')}   "
        f"ITL ms p50 {f(r['itl_ms']['p50'], '.3f')} p99 {f(r['itl_ms']['p99'], '.3f')} "
        f"mean {f(r['itl_ms']['mean'], '.3f')} coalesced {f(r['itl_ms']['coalesced_frac'], '.0%')} "
        f"stalls>=30ms {r['itl_ms']['stalls_ge_30ms']}",
        f"CPU s: server {f(r['server_cpu_s'], '.2f')} client {r['client_cpu_s']:.2f} "
        f"machine {r['machine_cpu_busy_s']:.2f}/{r['machine_cpu_total_s']:.2f}  "
        f"server RSS {f(r['server_rss_mib_end'], '.1f')} MiB",
    ]
    for s in r["error_samples"]:
        lines.append(f"  error sample: {s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", required=True)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("-d", "--duration", type=float, default=None, help="seconds (default 20)")
    g.add_argument("-n", "--requests", type=int, default=None, help="total requests instead of a duration")
    ap.add_argument("--words", type=int, default=200, help="prompt length in words")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="a new TCP connection per request")
    ap.add_argument("--client", choices=("raw", "aiohttp"), default="raw")
    ap.add_argument("--parse", choices=("scan", "json"), default="scan")
    ap.add_argument("--verify-echo", action="store_true", help="check streamed text == prompt (json parse)")
    ap.add_argument("--pid", type=int, default=None, help="server pid for CPU accounting")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--json", default=None, help="write the result as JSON to this file")
    args = ap.parse_args(argv)
    duration = args.duration if args.requests is None else None
    if args.requests is None and duration is None:
        duration = 20.0
    uv = False if args.no_uvloop else install_uvloop()
    r = asyncio.run(run_load(
        args.url, args.model, args.concurrency, duration, args.requests, args.words, args.max_tokens,
        args.fresh, args.client, args.parse, args.verify_echo, args.pid, args.timeout,
    ))
    r["config"]["uvloop"] = uv
    print(format_result(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()

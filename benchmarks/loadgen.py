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

Two client implementations (same measurement logic):
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
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads

MARK = b'"content":"'
EMPTY_MARK = b'"content":""'
DONE = b"data: [DONE]"

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


@dataclass
class Stats:
    tokens: int = 0
    requests_started: int = 0
    requests_ok: int = 0
    requests_aborted: int = 0  # cut at the end of the measuring window
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens_per_request: list[int] = field(default_factory=list)
    verify_failures: int = 0

    def error(self, kind: str, detail: str = "") -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if detail and len(self.error_samples) < 5:
            self.error_samples.append(f"{kind}: {detail[:300]}")


class RequestState:
    """Per-request SSE event handling, shared by both clients."""

    __slots__ = ("stats", "t_start", "t_last", "ntok", "evbuf", "done_seen", "json_mode", "text")

    def __init__(self, stats: Stats, t_start: float, json_mode: bool):
        self.stats = stats
        self.t_start = t_start
        self.t_last = 0.0
        self.ntok = 0
        self.evbuf = b""
        self.done_seen = False
        self.json_mode = json_mode
        self.text: list[str] | None = [] if json_mode else None

    def feed(self, payload: bytes, now: float) -> None:
        """Feed decoded body bytes received at time `now`."""
        if self.evbuf:
            payload = self.evbuf + payload
        if payload.endswith(b"\n\n"):
            complete = payload
            self.evbuf = b""
        else:
            cut = payload.rfind(b"\n\n")
            if cut < 0:
                self.evbuf = payload
                return
            complete = payload[: cut + 2]
            self.evbuf = payload[cut + 2 :]
        if self.json_mode:
            n = self._count_json(complete)
        else:
            n = complete.count(MARK)
            if n:
                n -= complete.count(EMPTY_MARK)
            if not self.done_seen and DONE in complete:
                self.done_seen = True
        if n > 0:
            st = self.stats
            st.tokens += n
            if self.ntok == 0:
                st.ttft.append(now - self.t_start)
            else:
                st.itl.append(now - self.t_last)
            if n > 1:
                st.itl.extend([0.0] * (n - 1))
            self.ntok += n
            self.t_last = now

    def _count_json(self, complete: bytes) -> int:
        n = 0
        for line in complete.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done_seen = True
                continue
            obj = _loads(data)
            for ch in obj.get("choices") or ():
                delta = ch.get("delta") or {}
                c = delta.get("content")
                if c:
                    n += 1
                    self.text.append(c)
        return n


# ----------------------------------------------------------------------------- raw client


class _Proto(asyncio.Protocol):
    """One HTTP/1.1 connection; one streaming request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future | None = None
        self.req: RequestState | None = None
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.phase = 0  # 0 headers, 1 chunked body, 2 content-length body, 3 until-close body
        self.hbuf = b""
        self.status = 0
        self.chunk_left = 0
        self.skip = 0
        self.pending = b""  # partial chunk-size line
        self.body_left = 0
        self.err_body = b""
        self.keep_alive = True

    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc):  # type: ignore[override]
        self.lost = True
        if self.phase == 3 and self.fut and not self.fut.done():
            self._finish()
            return
        if self.fut and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def start(self, request: bytes, req: RequestState) -> asyncio.Future:
        self._reset()
        self.req = req
        self.fut = self.loop.create_future()
        self.transport.write(request)
        return self.fut

    def _finish(self) -> None:
        self.phase = 4
        if self.fut and not self.fut.done():
            self.fut.set_result(self.status)

    def data_received(self, data: bytes) -> None:  # type: ignore[override]
        now = time.perf_counter()
        if self.phase == 0:
            data = self.hbuf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.hbuf = data
                return
            head = data[:end].decode("latin-1").split("\r\n")
            data = data[end + 4 :]
            try:
                self.status = int(head[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self.status = -1
            chunked = False
            clen = None
            for h in head[1:]:
                k, _, v = h.partition(":")
                k = k.strip().lower()
                v = v.strip().lower()
                if k == "transfer-encoding" and "chunked" in v:
                    chunked = True
                elif k == "content-length":
                    clen = int(v)
                elif k == "connection" and v == "close":
                    self.keep_alive = False
            if chunked:
                self.phase = 1
            elif clen is not None:
                self.phase = 2
                self.body_left = clen
                if clen == 0:
                    self._finish()
                    return
            else:
                self.phase = 3
                self.keep_alive = False
            if not data:
                return
        if self.phase == 1:
            self._chunked(data, now)
        elif self.phase in (2, 3):
            if self.status == 200:
                self.req.feed(data, now)
            elif len(self.err_body) < 2000:
                self.err_body += data
            if self.phase == 2:
                self.body_left -= len(data)
                if self.body_left <= 0:
                    self._finish()

    def _chunked(self, data: bytes, now: float) -> None:
        if self.pending:
            data = self.pending + data
            self.pending = b""
        n = len(data)
        pos = 0
        parts = []
        while pos < n:
            if self.chunk_left:
                take = min(self.chunk_left, n - pos)
                parts.append(data[pos : pos + take] if (pos or take != n) else data)
                pos += take
                self.chunk_left -= take
                if not self.chunk_left:
                    self.skip = 2
            elif self.skip:
                s = min(self.skip, n - pos)
                pos += s
                self.skip -= s
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self.pending = data[pos:]
                    break
                size = int(data[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    # last-chunk; trailers are not expected. Emit what we have, finish.
                    if parts:
                        self._emit(parts, now)
                        parts = []
                    self._finish()
                    return
                self.chunk_left = size
        if parts:
            self._emit(parts, now)

    def _emit(self, parts: list[bytes], now: float) -> None:
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.status == 200:
            self.req.feed(payload, now)
        elif len(self.err_body) < 2000:
            self.err_body += payload


class RawClient:
    def __init__(self, url: str, fresh: bool):
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.path = (u.path.rstrip("/") or "") + "/v1/chat/completions"
        self.fresh = fresh

    def build_request(self, body: bytes) -> bytes:
        return (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def worker(self, request: bytes, stats: Stats, json_mode: bool, next_ticket, timeout: float,
                     on_done) -> None:
        loop = asyncio.get_running_loop()
        proto: _Proto | None = None
        try:
            while next_ticket():
                t0 = time.perf_counter()
                req = RequestState(stats, t0, json_mode)
                stats.requests_started += 1
                try:
                    if proto is None or proto.lost or self.fresh:
                        if proto is not None:
                            proto.transport.close()
                        _, proto = await loop.create_connection(lambda: _Proto(loop), self.host, self.port)
                    status = await asyncio.wait_for(proto.start(request, req), timeout)
                except asyncio.CancelledError:
                    _abort(stats, req)
                    raise
                except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                    stats.error(type(e).__name__, str(e))
                    if proto is not None:
                        proto.transport.close()
                        proto = None
                    continue
                if status != 200:
                    stats.error(f"http_{status}", proto.err_body.decode("utf-8", "replace"))
                elif not req.done_seen:
                    stats.error("no_done", f"stream ended after {req.ntok} tokens without [DONE]")
                else:
                    _ok(stats, req, on_done)
                if not proto.keep_alive:
                    proto.transport.close()
                    proto = None
        finally:
            if proto is not None and proto.transport is not None:
                proto.transport.close()


def _abort(stats: Stats, req: RequestState) -> None:
    stats.requests_aborted += 1


def _ok(stats: Stats, req: RequestState, on_done) -> None:
    stats.requests_ok += 1
    stats.tokens_per_request.append(req.ntok)
    if req.ntok == 0:
        stats.error("no_tokens")
    if on_done is not None:
        on_done(req)


# ----------------------------------------------------------------------------- aiohttp client


class AiohttpClient:
    def __init__(self, url: str, fresh: bool, concurrency: int):
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.fresh = fresh
        self.concurrency = concurrency
        self.session = None

    async def open(self) -> None:
        import aiohttp

        conn = aiohttp.TCPConnector(limit=0, force_close=self.fresh, enable_cleanup_closed=False)
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def worker(self, body: bytes, stats: Stats, json_mode: bool, next_ticket, timeout: float,
                     on_done) -> None:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        while next_ticket():
            t0 = time.perf_counter()
            req = RequestState(stats, t0, json_mode)
            stats.requests_started += 1
            try:
                async with asyncio.timeout(timeout):
                    async with self.session.post(self.url, data=body, headers=headers) as resp:
                        if resp.status != 200:
                            text = await resp.text()
                            stats.error(f"http_{resp.status}", text)
                            continue
                        async for data in resp.content.iter_any():
                            req.feed(data, time.perf_counter())
            except asyncio.CancelledError:
                _abort(stats, req)
                raise
            except Exception as e:  # noqa: BLE001 - any failure is an error sample
                stats.error(type(e).__name__, str(e))
                continue
            if not req.done_seen:
                stats.error("no_done", f"stream ended after {req.ntok} tokens without [DONE]")
            else:
                _ok(stats, req, on_done)


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
) -> dict[str, Any]:
    prompt = make_prompt(prompt_words)
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
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

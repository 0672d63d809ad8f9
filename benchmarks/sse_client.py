"""The streaming HTTP/SSE client of the load generator (benchmarks/loadgen.py) and its per-request counting.

``RequestState`` turns the SSE bytes of one ``stream: true`` chat request into tokens, TTFT and ITL
samples in a shared ``Stats``: by counting ``"content":"`` in complete events (scan) or by decoding every
``data:`` event (json, which also keeps the text).  Two clients feed it:

  ``RawClient``      one ``StreamProtocol`` (asyncio.Protocol) per connection, a minimal HTTP/1.1 + chunked
                     decoder, TCP_NODELAY; the cheapest on CPU;
  ``AiohttpClient``  aiohttp.ClientSession, ``resp.content.iter_any()``.

``StreamProtocol`` is also used on its own by benchmarks/router/client.py and benchmarks/llamacpp_compare.py,
with their own request states (anything with ``feed(payload, now)``).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

try:
    import orjson

    json_loads = orjson.loads
except ImportError:  # pragma: no cover
    json_loads = json.loads

MARK = b'"content":"'
EMPTY_MARK = b'"content":""'
DONE = b"data: [DONE]"


@dataclass
class Stats:
    """What the requests of one run add up to (filled by every RequestState of the run)."""

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
            obj = json_loads(data)
            self._on_event(obj)
            for ch in obj.get("choices") or ():
                delta = ch.get("delta") or {}
                c = delta.get("content")
                if c:
                    n += 1
                    self.text.append(c)
        return n

    def _on_event(self, obj: dict[str, Any]) -> None:
        """Each JSON event of the stream, before its content is counted (a subclass keeps more of it)."""


# ----------------------------------------------------------------------------- raw client


class StreamProtocol(asyncio.Protocol):
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
        proto: StreamProtocol | None = None
        try:
            while next_ticket():
                t0 = time.perf_counter()
                req = RequestState(stats, t0, json_mode)
                stats.requests_started += 1
                try:
                    if proto is None or proto.lost or self.fresh:
                        if proto is not None:
                            proto.transport.close()
                        _, proto = await loop.create_connection(lambda: StreamProtocol(loop), self.host, self.port)
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

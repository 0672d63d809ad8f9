#!/usr/bin/env python3
"""What the HTTP server itself costs per streamed token: aiohttp (what the frontend runs) against a bare
``asyncio.Protocol`` with the ``httptools`` parser (the leanest Python HTTP/1.1 server one can write on
uvloop), both streaming the same paced OpenAI chunks, with no pipeline, engine or tokenizer behind them.

    PYTHONPATH=src .venv/bin/python -m benchmarks.http_floor [--streams 256] [--delay-ms 10] [--tokens 200] \\
        [--duration 15] [--rounds 2] [--httptools DIR]

``httptools`` is not a dependency of dynamo-run: install it for this benchmark only, e.g.
``pip install --target /tmp/httptools httptools==0.9.0`` and pass ``--httptools /tmp/httptools``.

Each server is a subprocess (``--serve aiohttp|httptools PORT``) on uvloop.  Per request it streams
``--tokens`` chunks, one per ``--delay-ms`` against a deadline (as the echo engine paces), each chunk an
``orjson.dumps`` of a chat-completion chunk written straight to the transport as an HTTP chunk (as the
frontend's SSE writer does; the tokens already due when a stream wakes leave in one write, as there),
then ``[DONE]``; keep-alive.  The client is ``benchmarks/loadgen.py`` (raw
HTTP/SSE, uvloop), ``--streams`` concurrent keep-alive connections for ``--duration`` seconds; the servers
alternate ``--rounds`` times.  Printed per run: server CPU µs per token, tokens/s, ITL p99, the load
average.  The two servers differ only in what parses the request and starts the response (aiohttp:
its protocol, request object, router and ``StreamResponse``; httptools: a callback parser and one
``transport.write`` of the headers), so the difference is what a leaner HTTP server could save the
frontend per token, and either figure is the floor of a frontend that paces tokens with one timer per
stream in Python.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import loadgen

CHUNK_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "floor"}


async def stream_tokens(write: Any, is_closing: Any, tokens: int, delay: float) -> None:
    """The same paced stream for both servers: one HTTP chunk per token against a deadline, then [DONE]
    (the server ends the chunked body)."""
    import orjson

    loop = asyncio.get_running_loop()
    deadline = loop.time()
    i = 0
    while i < tokens:
        deadline += delay
        wait = deadline - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if is_closing():
            return
        # every token already due leaves in one write, as the frontend's SSE writer batches what is ready
        parts = []
        while i < tokens and (not parts or deadline + delay <= loop.time()):
            if parts:
                deadline += delay
            parts.append(b"data: " + orjson.dumps({**CHUNK_HEAD, "choices": [
                {"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}) + b"\n\n")
            i += 1
        data = b"".join(parts)
        write(b"%x\r\n%b\r\n" % (len(data), data))
    if not is_closing():
        done = b"data: [DONE]\n\n"
        write(b"%x\r\n%b\r\n" % (len(done), done))


HEADERS = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")


def serve_httptools(port: int, tokens: int, delay: float) -> None:
    import httptools

    class Proto(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.transport: asyncio.Transport | None = None
            self.busy: asyncio.Task[None] | None = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                assert self.transport is not None
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self.transport.close()

        def on_message_complete(self) -> None:
            t = self.transport
            assert t is not None
            t.write(HEADERS)
            self.busy = asyncio.ensure_future(self.respond(t))

        async def respond(self, t: asyncio.Transport) -> None:
            await stream_tokens(t.write, t.is_closing, tokens, delay)
            if not t.is_closing():
                t.write(b"0\r\n\r\n")

        def connection_lost(self, exc: Any) -> None:
            if self.busy is not None:
                self.busy.cancel()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Proto, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


def serve_aiohttp(port: int, tokens: int, delay: float) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            t = request.transport
            if t is None:
                return resp
            # the frontend's SSE writer writes its HTTP chunks straight to the transport too
            await stream_tokens(t.write, t.is_closing, tokens, delay)
            await resp.write_eof()
        except ConnectionError:  # the client left (the load's end)
            pass
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def run_one(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    port = loadgen_free_port()
    env = dict(os.environ)
    if args.httptools:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(args.httptools)) if p)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.http_floor", "--serve", kind, str(port),
                             "--tokens", str(args.tokens), "--delay-ms", str(args.delay_ms)],
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"{kind} server did not start")
        load = os.getloadavg()[0]
        r = asyncio.run(loadgen.run_load(f"http://127.0.0.1:{port}", "floor", args.streams, args.duration,
                                         prompt_words=20, server_pid=proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)
    us = 1e6 * r["server_cpu_s"] / max(r["tokens"], 1)
    print(f"  {kind:9s} {us:6.1f} µs CPU/token, {r['tokens_per_s']:8.0f} tok/s, ITL p99 {r['itl_ms']['p99']:.1f} ms, "
          f"{r['requests_ok']} requests, {r['errors']} errors, load {load:.1f}", flush=True)
    return {"kind": kind, "cpu_us_per_token": us, "load": load, "result": r}


def loadgen_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per request")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--httptools", default=None, help="a folder holding httptools (pip install --target)")
    args = ap.parse_args()
    if args.serve:
        import uvloop

        uvloop.install()
        kind, port = args.serve
        (serve_httptools if kind == "httptools" else serve_aiohttp)(int(port), args.tokens, args.delay_ms / 1e3)
        return
    loadgen.install_uvloop()
    print(f"http_floor: {args.streams} streams, {args.delay_ms:g} ms, {args.tokens} tokens/request, "
          f"{args.duration:g} s x {args.rounds} rounds, load {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[float]] = {"aiohttp": [], "httptools": []}
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        for kind in ("aiohttp", "httptools"):
            runs[kind].append(run_one(kind, args)["cpu_us_per_token"])
            time.sleep(1)
    a, h = statistics.median(runs["aiohttp"]), statistics.median(runs["httptools"])
    print(f"median µs CPU/token: aiohttp {a:.1f}, httptools {h:.1f} (httptools/aiohttp {h / a:.2f})")


if __name__ == "__main__":
    main()

"""CPU per token of the streaming path alone: echo engine -> pipeline -> SSE writer, no sockets, no client.

    PYTHONPATH=src .venv/bin/python -m benchmarks.sse_pump_cost [--streams 256] [--delay-ms 10]
        [--duration 5] [--repeats 3]

Every stream is a real chat request through ``FullPipeline`` + ``echo_full`` + ``stream_sse`` (the pump,
the chunk sink, the request metrics) on uvloop, as in the server; only aiohttp's request is a mocked
one whose transport drops what is written (a C call, so the write costs nothing here).  What is left is
the Python per token and the loop's timers and task wake-ups, measured as this process's CPU time over
a window after a warm-up (every stream started) / tokens.  Nothing else runs in the process, so the figure is steadier on a shared machine than
a server's with its client, which makes it the tool for comparing two versions of the per-token path
(run each version alternately); the server's own figure is echo_compare's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from benchmarks.loadgen import install_uvloop, make_prompt
from dynamo.engines.echo import EchoFullEngine
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.sse import stream_sse
from dynamo.heap import settle_heap
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.pipeline import FullPipeline
from dynamo.llm.protocols.openai import parse_chat_request


class NullTransport(asyncio.Transport):
    """Counts the writes and drops the bytes (``write`` is a list's ``append``: no Python frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.write = self.sent.append  # type: ignore[method-assign]

    def writelines(self, chunks: Any) -> None:
        self.sent.append(b"".join(chunks))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class NullProtocol:
    def __init__(self, transport: NullTransport) -> None:
        self.transport = transport
        self._paused = False
        self.ssl_context = None
        self.peername = None
        self.sockname = None


async def one_stream(model: FullPipeline, metrics: FrontendMetrics, body: dict[str, Any], stop: list[bool],
                     live: list[Any], done: list[int]) -> None:
    loop = asyncio.get_running_loop()
    while not stop[0]:
        transport = NullTransport()
        protocol = NullProtocol(transport)
        writer = StreamWriter(protocol, loop)  # type: ignore[arg-type]
        request = make_mocked_request("POST", "/v1/chat/completions", writer=writer, transport=transport,
                                      protocol=protocol)
        ctx = Context()
        rm = metrics.request("m", "chat_completions", True)
        req = parse_chat_request(body)
        me = (ctx, transport)
        live.append(me)
        try:
            _, ok = await stream_sse(request, model.chat(req, body, ctx), ctx, rm)
        finally:
            live.remove(me)
            done[0] += ctx.completion_tokens
            done[1] += len(transport.sent)
        rm.done(ok)


def _counts(live: list[Any], done: list[int]) -> tuple[int, int]:
    return (done[0] + sum(ctx.completion_tokens for ctx, _ in live),
            done[1] + sum(len(t.sent) for _, t in live))


async def run(streams: int, delay: float, duration: float, warmup: float) -> tuple[float, float, int]:
    """CPU µs per token over the window after the warm-up, tokens per write, tokens."""
    settle_heap()  # the server's collector settings
    model = FullPipeline("m", ModelCard.placeholder("m"), EchoFullEngine(delay))
    metrics = FrontendMetrics()
    body = {"model": "m", "messages": [{"role": "user", "content": make_prompt(200)}], "stream": True}
    stop = [False]
    live: list[Any] = []
    done = [0, 0]
    tasks = [asyncio.ensure_future(one_stream(model, metrics, body, stop, live, done)) for _ in range(streams)]
    await asyncio.sleep(warmup)  # every stream started (start-up costs are the server's, not per token)
    t0, (k0, w0) = time.process_time(), _counts(live, done)
    await asyncio.sleep(duration)
    t1, (k1, w1) = time.process_time(), _counts(live, done)
    stop[0] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tokens = k1 - k0
    return (t1 - t0) / tokens * 1e6, tokens / max(w1 - w0, 1), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=1.0)
    args = ap.parse_args()
    install_uvloop()
    figures = []
    for _ in range(args.repeats):
        us, per_write, tokens = asyncio.run(run(args.streams, args.delay_ms / 1000, args.duration, args.warmup))
        figures.append(us)
        print(f"{us:.2f} us CPU per token, {per_write:.2f} tokens per write, {tokens} tokens")
    print(f"median {statistics.median(figures):.2f} us per token (spread {min(figures):.2f}-{max(figures):.2f})")


if __name__ == "__main__":
    main()

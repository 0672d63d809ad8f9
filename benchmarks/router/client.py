"""The router benchmark's client: streaming chat requests over loadgen's raw HTTP/1.1 protocol
(benchmarks/sse_client.py), one ``Record`` per request, and ``drive``, which runs a workload's
conversations (benchmarks/router/workload.py) against a frontend."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import orjson

from benchmarks.router.workload import Conversation, WorkloadConfig
from benchmarks.sse_client import StreamProtocol


class StreamedRequest:
    """One streaming request's measurements (fed by loadgen's raw HTTP/1.1 protocol)."""

    __slots__ = ("t0", "first", "last", "gaps", "events", "usage", "done", "buf", "text")

    def __init__(self, t0: float, keep_text: bool = False):
        self.t0 = t0
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.buf = b""
        self.text: list[str] | None = [] if keep_text else None  # the content, when the client needs it

    def feed(self, payload: bytes, now: float) -> None:
        data = self.buf + payload
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.buf = data
            return
        self.buf = data[cut + 2:]
        n = 0
        for line in data[:cut].split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                self.done = True
                continue
            obj = orjson.loads(body)
            for ch in obj.get("choices") or ():
                content = (ch.get("delta") or {}).get("content")
                if content:
                    n += 1
                    if self.text is not None:
                        self.text.append(content)
            if obj.get("usage"):
                self.usage = obj["usage"]
        if n:
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.gaps.extend([0.0] * (n - 1))
            self.events += n
            self.last = now


class ChatClient:
    """Streaming chat requests to a frontend on 127.0.0.1, over kept-alive connections."""

    def __init__(self, port: int):
        self.port = port
        self.idle: list[StreamProtocol] = []

    async def chat(self, body: dict[str, Any], timeout: float = 180.0, keep_text: bool = False
                   ) -> tuple[StreamedRequest, int, str]:
        loop = asyncio.get_running_loop()
        raw = orjson.dumps(body)
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                   "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                   f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw
        proto = None
        while self.idle:
            p = self.idle.pop()
            if not p.lost:
                proto = p
                break
        t0 = time.perf_counter()
        req = StreamedRequest(t0, keep_text)
        if proto is None:
            _, proto = await loop.create_connection(lambda: StreamProtocol(loop), "127.0.0.1", self.port)
        try:
            status = await asyncio.wait_for(proto.start(request, req), timeout)
        except BaseException:
            proto.transport.close()
            raise
        err = proto.err_body.decode("utf-8", "replace") if status != 200 else ""
        if proto.keep_alive and not proto.lost:
            self.idle.append(proto)
        else:
            proto.transport.close()
        return req, status, err

    def close(self) -> None:
        for p in self.idle:
            p.transport.close()
        self.idle.clear()


@dataclass
class Record:
    cid: int
    turn: int
    group: int
    sent: float  # seconds since the run started
    status: int
    error: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    duration: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says


async def drive(port: int | Sequence[int], convs: list[Conversation], cfg: WorkloadConfig, model: str
                ) -> tuple[list[Record], float, float]:
    """Run the conversations of the workload against the frontend on ``port`` (asking for ``model``): open
    loop at their start times, or closed loop with ``cfg.clients`` clients; every request's record, and the
    times the first was sent and the last ended.  Several ports (several frontends in front of the same
    workers): client ``i`` talks to port ``i mod n`` (open loop: conversation ``cid mod n``)."""
    ports = [port] if isinstance(port, int) else list(port)
    chat_clients = [ChatClient(p) for p in ports]
    records: list[Record] = []
    start = time.perf_counter()
    said: dict[int, list[str]] = {}  # with cfg.real_answers: each conversation's answers so far (this run's)

    async def send(c: Conversation, turn: int, via: int) -> bool:
        """Send turn ``turn`` of ``c`` and record it; False if it failed."""
        answers = said.setdefault(c.cid, []) if cfg.real_answers else None
        body: dict[str, Any] = {"model": model, "messages": c.messages(turn, answers), "max_tokens": cfg.osl,
                                "stream": True, "stream_options": {"include_usage": True}}
        if cfg.real_answers:
            body["temperature"] = 0
        sent = time.perf_counter()
        try:
            req, status, err = await chat_clients[via % len(chat_clients)].chat(body, keep_text=cfg.real_answers)
        except (OSError, ConnectionError, asyncio.TimeoutError) as e:
            records.append(Record(c.cid, turn, c.group, sent - start, -1, f"{type(e).__name__}: {e}"))
            return False
        rec = Record(c.cid, turn, c.group, sent - start, status, err[:300])
        rec.ttft = None if req.first is None else req.first - req.t0
        rec.gaps = req.gaps
        rec.duration = time.perf_counter() - sent
        if req.usage:
            rec.prompt_tokens = int(req.usage.get("prompt_tokens") or 0)
            rec.completion_tokens = int(req.usage.get("completion_tokens") or 0)
            details = req.usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        if status == 200 and not req.done:
            rec.error = "stream ended without [DONE]"
        if answers is not None and req.text is not None:
            answers.append("".join(req.text))
        records.append(rec)
        return status == 200 and not rec.error

    async def one(c: Conversation, via: int | None = None) -> bool:
        """Run one conversation; False if a request failed (the conversation stops there)."""
        await asyncio.sleep(max(0.0, start + c.start - time.perf_counter()))
        for turn in range(cfg.turns):
            if turn:
                await asyncio.sleep(c.thinks[turn - 1])
            if not await send(c, turn, c.cid if via is None else via):
                return False
        return True

    if cfg.clients > 0 and cfg.interleave:
        # closed loop over conversations that interleave: a free client sends one of the follow-up turns
        # whose user has finished thinking, picked at random, else it opens the next conversation of the
        # pool; so which client (and, under round-robin, which worker) carries a turn does not depend on
        # which carried the turn before.  (Oldest first would keep two conversations in lockstep with two
        # clients, the same accident as one conversation per client.)
        pool = iter(convs)
        waiting: list[tuple[float, int]] = []  # (ready at, conversation index) of each follow-up turn
        next_turn: dict[int, int] = {}
        by_cid = {c.cid: c for c in convs}
        pick = random.Random(cfg.seed + 2)

        async def interleaved_client(via: int) -> None:
            while time.perf_counter() - start < cfg.duration:
                now = time.perf_counter()
                ready = [i for i, (at, _) in enumerate(waiting) if at <= now]
                if ready:
                    c = by_cid[waiting.pop(pick.choice(ready))[1]]
                    turn = next_turn[c.cid]
                else:
                    nxt = next(pool, None)
                    if nxt is None:
                        return
                    c, turn = nxt, 0
                if not await send(c, turn, via):
                    return
                if turn + 1 < cfg.turns:
                    next_turn[c.cid] = turn + 1
                    waiting.append((time.perf_counter() + c.thinks[turn], c.cid))

        await asyncio.gather(*(interleaved_client(i) for i in range(cfg.clients)))
    elif cfg.clients > 0:  # closed loop: each client runs the next conversation of the pool when done
        pool = iter(convs)

        async def client_loop(via: int) -> None:
            while time.perf_counter() - start < cfg.duration:
                c = next(pool, None)
                if c is None or not await one(c, via):
                    return

        await asyncio.gather(*(client_loop(i) for i in range(cfg.clients)))
    else:
        await asyncio.gather(*(one(c) for c in convs))
    end = time.perf_counter()
    for cc in chat_clients:
        cc.close()
    return records, start, end

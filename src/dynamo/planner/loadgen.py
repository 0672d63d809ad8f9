"""A small async load generator for measuring a fleet: streamed ``/v1/completions`` requests with prompts
given as token ids (so the input length is exact, whatever the tokenizer), TTFT and ITL per request.

The profiler sweeps a worker with it and the planner benchmark replays traces with it.  It is ours rather
than a dependency because what it must do is narrow (exact input lengths, prompts that share prefixes by
Mooncake ``hash_ids``, the timing of each request) and aiohttp, already a dependency, does the HTTP.

Timing of one request, as Dynamo's planner and its benchmarks define them: TTFT from sending the request
to the first streamed token; ITL the request's mean gap between tokens after the first, ``(end - first) /
(output_tokens - 1)``, where ``output_tokens`` is the usage the server reports.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import aiohttp
import orjson

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
FIRST_TOKEN_ID = 300  # token ids used in prompts: above byte-level BPE's 256 bytes and the special tokens


@dataclass
class RequestResult:
    """One request: when it was sent (seconds from the run's start), its lengths, its timing, its error."""

    sent_at: float
    isl: int
    max_tokens: int
    ttft_s: float | None = None
    itl_s: float | None = None
    output_tokens: int = 0
    duration_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prompt_tokens(isl: int, hash_ids: Sequence[int] = (), *, vocab_size: int,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS, salt: int = 0) -> list[int]:
    """``isl`` token ids; the ``i``-th block of ``block_tokens`` is drawn from ``hash_ids[i]`` alone, so two
    prompts with the same leading hash ids share that prefix (and a KV cache can reuse it); tokens past the
    hash ids are drawn from ``salt`` (give each request its own to keep them apart)."""
    span = max(1, vocab_size - FIRST_TOKEN_ID)
    out: list[int] = []
    for i, start in enumerate(range(0, isl, block_tokens)):
        seed = hash_ids[i] if i < len(hash_ids) else (salt << 20) + i
        rng = random.Random(seed)
        out.extend(FIRST_TOKEN_ID + rng.randrange(span) for _ in range(min(block_tokens, isl - start)))
    return out


class LoadGenerator:
    """Streams requests at one frontend (``base_url``) for one model; ``async with`` for its session."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 300.0) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "LoadGenerator":
        connector = aiohttp.TCPConnector(limit=0)  # as many connections as requests in flight
        self._session = aiohttp.ClientSession(connector=connector,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self.started = time.monotonic()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, prompt: list[int], max_tokens: int) -> RequestResult:
        """One streamed request; errors (HTTP status, error events, a broken stream) end up in ``error``."""
        assert self._session is not None, "use the LoadGenerator in 'async with'"
        start = time.monotonic()
        result = RequestResult(sent_at=start - self.started, isl=len(prompt), max_tokens=max_tokens)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        first = last = None
        try:
            async with self._session.post(self.url, data=orjson.dumps(body),
                                          headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return result
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    event = orjson.loads(payload)
                    if "error" in event:
                        result.error = str(event["error"])[:200]
                        continue
                    if event.get("choices"):
                        last = time.monotonic()
                        if first is None:
                            first = last
                    usage = event.get("usage")
                    if usage:
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                if not done and result.error is None:
                    result.error = "the stream ended without [DONE]"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        end = time.monotonic()
        result.duration_s = end - start
        if first is not None:
            result.ttft_s = first - start
            if last is not None and result.output_tokens > 1:
                result.itl_s = (last - first) / (result.output_tokens - 1)
        if result.error is None and result.output_tokens != max_tokens:
            result.error = f"{result.output_tokens} tokens instead of {max_tokens}"
        return result

    async def closed_loop(self, prompts: Iterable[list[int]], max_tokens: int, concurrency: int,
                          requests: int) -> list[RequestResult]:
        """``concurrency`` streams, each sending its next request when the last one ends, ``requests`` in
        all (the decode sweep: the worker holds about ``concurrency`` streams the whole time)."""
        source = iter(prompts)
        results: list[RequestResult] = []
        remaining = [requests]

        async def stream() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                results.append(await self.send(next(source), max_tokens))

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return results

    async def replay(self, schedule: Sequence[tuple[float, list[int], int]]) -> list[RequestResult]:
        """Send each ``(at_seconds, prompt, max_tokens)`` at its time from now (open loop: a slow fleet
        does not slow the arrivals down, as in production)."""
        t0 = time.monotonic()
        self.started = t0
        tasks: list[asyncio.Task] = []
        for at, prompt, max_tokens in schedule:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.send(prompt, max_tokens)))
        return list(await asyncio.gather(*tasks))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)

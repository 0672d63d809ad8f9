"""llama.cpp workers lending each other cached prefixes, for real (SmolLM2 GGUF, in process, real TCP).

A worker told to fetch a prompt's prefix from another loads that worker's KV state and computes only the
rest: its greedy answer is the one it gives when the same prefix comes from its own cache, and it reports
the fetched tokens as cached.  (Not always the one it gives computing the whole prompt at once: llama.cpp's
results depend on how the prompt was split into batches, so greedy answers from a cache split at another
token can part after a few tokens; measured here, a fetched prefix of 64 or 104 tokens did, 100 or 108 did
not, and a local cache split at the same token gave the fetched answer every time.)  A holder that no longer has the prefix, is gone, or stalls costs the fetcher its own prefill,
never the answer; a holder busy generating lends between two of its steps and its own stream is unchanged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dynamo.disagg.prefix_share import PrefixSharingEngine
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, SamplingOptions, StopConditions
from harness.wait import until

pytestmark = pytest.mark.timeout(240)

SYSTEM = ("You are a patient assistant for a bookshop. You answer questions about opening hours, orders, "
          "returns and recommendations. Keep every answer short and polite, and never invent a title. ") * 3


LIGHTHOUSE = ("You are a storyteller for children. Your stories are gentle, have a clear beginning, middle and "
              "end, and always include an animal that helps the hero. ") * 3


def chat(tok: Any, user: str, system: str = SYSTEM) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def req(prompt: list[int], n: int = 12, source: dict[str, Any] | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=list(prompt), stop_conditions=StopConditions(max_tokens=n),
                               sampling_options=SamplingOptions(temperature=0), eos_token_ids=[2],
                               prefix_source=source)


async def answer(engine: Any, r: PreprocessedRequest) -> tuple[list[int], int]:
    """(the tokens, the cached prompt tokens it reported)."""
    toks, cached = [], None
    async for out in engine.generate(r, Context()):
        toks += out.token_ids
        if cached is None and out.cached_tokens is not None:
            cached = out.cached_tokens
    return toks, cached or 0


async def computed_here(gguf: Path, prompt: list[int], cached: int, n: int = 12) -> list[int]:
    """The greedy answer of a fresh engine whose own cache holds ``prompt[:cached]``: the reference."""
    engine = await _engine(gguf)
    try:
        if cached:
            await answer(engine, req(prompt[:cached], n=1))
        toks, reused = await answer(engine, req(prompt, n=n))
        assert reused == cached
        return toks
    finally:
        await engine.close()


async def computed_after(gguf: Path, first: PreprocessedRequest, prompt: list[int], cached: int,
                         n: int = 12) -> list[int]:
    """The greedy answer to ``prompt`` of a fresh engine that first served ``first`` (so its cache holds that
    turn computed as a lender's does), reusing ``cached`` tokens of it."""
    engine = await _engine(gguf)
    try:
        await answer(engine, first)
        toks, reused = await answer(engine, req(prompt, n=n))
        assert reused >= cached
        return toks
    finally:
        await engine.close()


async def _engine(gguf: Path) -> Any:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(gguf, context_length=1024, args={"n_parallel": 2, "n_threads": 1})
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(gguf):
    holder = PrefixSharingEngine(await _engine(gguf), host="127.0.0.1")
    fetcher = PrefixSharingEngine(await _engine(gguf), host="127.0.0.1", timeout=10)
    for e in (holder, fetcher):
        await e.start()
    try:
        yield holder, fetcher, gguf
    finally:
        for e in (holder, fetcher):
            await e.close()


def source(engine: PrefixSharingEngine, tokens: int) -> dict[str, Any]:
    return {"address": engine.server.address, "tokens": tokens}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_fetched_prefix_gives_the_answer_computed_alone(fleet, tok):
    holder, fetcher, gguf = fleet
    first, second = chat(tok, "When do you open on Sundays?"), chat(tok, "Can I return a book without a receipt?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared > 100  # the system prompt
    await answer(holder, req(first))  # the holder now caches the system prompt
    lent = holder.engine.caches.lent
    got, cached = await answer(fetcher, req(second, source=source(holder, shared)))
    assert cached == shared  # the fetched tokens were not computed again
    assert got == await computed_here(gguf, second, shared)
    assert fetcher.fetched == 1 and holder.engine.caches.lent == lent + 1
    assert fetcher.engine.caches.borrowed == 1
    # the fetched prefix is the fetcher's own now: the next prompt of that system prompt reuses it locally
    third = chat(tok, "Do you sell gift cards?")
    got, cached = await answer(fetcher, req(third))
    assert cached >= shared and got == await computed_here(gguf, third, cached)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_holder_without_the_prefix_costs_only_the_prefill(fleet, tok):
    holder, fetcher, gguf = fleet
    prompt = tok.encode("<|im_start|>user\nA question nobody asked before, about trains.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    failed = fetcher.failed
    got, cached = await answer(fetcher, req(prompt, source=source(holder, len(prompt))))
    assert cached == 0 and got == await computed_here(gguf, prompt, 0)
    assert fetcher.failed == failed + 1


@pytest.mark.asyncio(loop_scope="module")
async def test_a_gone_or_stalled_holder_costs_the_timeout_and_the_answer_is_right(fleet, tok):
    _, fetcher, gguf = fleet
    prompt = chat(tok, "What is your phone number?")
    # a holder that accepts and never answers (a SIGSTOPped worker): the fetch gives up after its timeout
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    fetcher.timeout = 0.5
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, cached = await answer(fetcher, req(prompt, source={"address": f"127.0.0.1:{port}", "tokens": 200}))
        assert loop.time() - t0 < 10 and got == await computed_here(gguf, prompt, cached)
        silent.close()
        await silent.wait_closed()
        got, cached = await answer(fetcher, req(prompt, source={"address": f"127.0.0.1:{port}", "tokens": 200}))
        assert got == await computed_here(gguf, prompt, cached)  # nobody listening there any more
    finally:
        fetcher.timeout = 10


@pytest.mark.asyncio(loop_scope="module")
async def test_a_busy_holder_lends_between_steps_and_its_own_stream_is_unchanged(fleet, tok):
    holder, fetcher, gguf = fleet
    long_one = chat(tok, "Tell me a long story about a lighthouse keeper and his cat.", LIGHTHOUSE)
    want_long = await computed_here(gguf, long_one, 0, n=80)
    stream = holder.generate(req(long_one, n=80), Context())
    got_long = []
    async for out in stream:  # the holder is generating: its slot holds the system prompt and the story
        got_long += out.token_ids
        if len(got_long) == 10:
            break
    q = chat(tok, "Tell me a story about a baker and a goose.", LIGHTHOUSE)
    borrowed = fetcher.engine.caches.borrowed
    fetching = asyncio.create_task(answer(fetcher, req(q, source=source(holder, len(long_one) - 20))))
    async for out in stream:
        got_long += out.token_ids
    await stream.aclose()
    got, cached = await fetching
    assert got_long == want_long
    assert fetcher.engine.caches.borrowed == borrowed + 1 and cached > 100
    assert got == await computed_here(gguf, q, cached)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_waiting_for_its_prefix_keeps_its_place_in_line_without_spinning(fleet, tok):
    """While a fetch is on its way, the request is in line already: one that arrives after it is not
    admitted before it (it would take the engine's next step), and the engine sleeps meanwhile."""
    import time

    _, fetcher, gguf = fleet
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # a holder that never answers
    port = silent.sockets[0].getsockname()[1]
    fetcher.timeout = 0.6
    first = chat(tok, "Which languages do you stock books in?")
    later = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    try:
        loop = asyncio.get_running_loop()
        t0, cpu0 = loop.time(), time.process_time()
        waiting = asyncio.create_task(answer(fetcher, req(first, source={"address": f"127.0.0.1:{port}",
                                                                         "tokens": len(first)})))
        await asyncio.sleep(0.05)
        stamps: list[float] = []

        async def after() -> list[int]:
            toks = []
            async for out in fetcher.generate(req(later), Context()):
                stamps.append(loop.time())
                toks += out.token_ids
            return toks

        later_task = asyncio.create_task(after())
        await asyncio.sleep(0.4)
        assert time.process_time() - cpu0 < 0.2  # both wait, and nothing spins meanwhile
        assert not stamps
        later_toks = await later_task
        assert stamps[0] - t0 >= 0.55  # it waited behind the fetching request until that fetch gave up
        got, cached = await waiting
        assert got == await computed_here(gguf, first, cached)
        assert later_toks == await computed_here(gguf, later, 0)
    finally:
        fetcher.timeout = 10
        silent.close()
        await silent.wait_closed()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_client_leaving_while_its_prefix_is_fetched_frees_the_line(fleet, tok):
    """The client goes away while the fetch is stalled: the request leaves the line at once, and the next
    request is served without waiting out the fetch's timeout."""
    _, fetcher, gguf = fleet
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    fetcher.timeout = 8
    try:
        prompt = chat(tok, "Do you ship abroad?")
        leaving = asyncio.create_task(answer(fetcher, req(prompt, source={"address": f"127.0.0.1:{port}",
                                                                          "tokens": len(prompt)})))
        await asyncio.sleep(0.2)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        nxt = tok.encode("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, cached = await asyncio.wait_for(answer(fetcher, req(nxt)), 6)  # well before the 8 s timeout
        assert loop.time() - t0 < 6 and got == await computed_here(gguf, nxt, cached)
    finally:
        fetcher.timeout = 10
        silent.close()
        await silent.wait_closed()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_finished_turn_is_lent_from_host_memory_while_the_holder_is_in_a_long_prefill(fleet, tok):
    """A lender keeps each finished turn (prompt and answer) in its host tier: a fetch of it is served from
    there while the holder's engine is in the middle of another prompt's prefill, instead of after that
    step, and the borrower's answer is the one its own cache would give."""
    holder, fetcher, gguf = fleet
    turn = chat(tok, "What are your opening hours on Saturdays?")
    said, _ = await answer(holder, req(turn, n=8))
    kept = turn + said[:-1]  # (the last token sampled is never decoded into the cache)
    # the finished turn goes to host memory just after its last token went out
    await until(lambda: holder.engine.caches.host_tier.touch(tuple(kept)), 5, "the finished turn in the host tier")
    # the holder starts a long prompt of its own (a prefill of seconds on one thread)
    long_prompt = chat(tok, "Write a long letter to a friend about the sea, the harbour and the boats. " * 9,
                       LIGHTHOUSE)
    firsts: list[float] = []

    async def long_request() -> None:
        async for _ in holder.generate(req(long_prompt, n=2), Context()):
            firsts.append(asyncio.get_running_loop().time())

    busy = asyncio.create_task(long_request())
    await until(lambda: holder.engine.scheduler.active() > 0, 10, "the long prompt admitted")  # prefill under way
    at_once = holder.engine.caches.lent_at_once
    next_turn = kept + tok.encode("<|im_end|>\n<|im_start|>user\nAnd on Sundays?<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    got, cached = await answer(fetcher, req(next_turn, source=source(holder, len(kept) // 16 * 16)))
    assert not firsts  # served while the holder was still computing the long prompt
    assert holder.engine.caches.lent_at_once == at_once + 1
    assert cached >= len(kept) // 16 * 16
    await busy
    # the reference is computed as the lent state was: the turn's prompt in one prefill, its answer a token at
    # a time (with AMX kernels a prefix computed in one batch differs in the last bits, which can change a
    # greedy token a few steps on)
    assert got == await computed_after(gguf, req(turn, n=8), next_turn, cached)

"""n > 1 merging: chunks relabelled by choice, counts summed, a failing choice or a leaving client stops all."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest

from dynamo.llm.engine import Context
from dynamo.llm.fanout import child_contexts, merge_choices


async def choice(ctx: Context, n: int, fail: bool = False) -> AsyncIterator[dict[str, Any]]:
    ctx.prompt_tokens = 5
    for k in range(n):
        if ctx.is_stopped:
            return
        ctx.completion_tokens = k + 1
        yield {"choices": [{"index": 0, "delta": {"content": str(k)}, "finish_reason": None}]}
        await asyncio.sleep(0)
        if fail and k == 1:
            raise RuntimeError("engine died")


async def test_chunks_are_relabelled_and_counts_summed():
    ctx = Context()
    kids = child_contexts(ctx, 3)
    got = [c async for c in merge_choices([choice(k, 2) for k in kids], ctx, kids,
                                          lambda p, c, cached: {"usage": {"prompt_tokens": p, "completion_tokens": c}})]
    assert sorted(c["choices"][0]["index"] for c in got[:-1]) == [0, 0, 1, 1, 2, 2]
    assert got[-1] == {"usage": {"prompt_tokens": 5, "completion_tokens": 6}}
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (5, 6)


async def test_a_failing_choice_stops_the_others():
    ctx = Context()
    kids = child_contexts(ctx, 2)
    with pytest.raises(RuntimeError, match="engine died"):
        async for _ in merge_choices([choice(kids[0], 100, fail=True), choice(kids[1], 100)], ctx, kids, None):
            pass
    assert all(k.is_stopped for k in kids)


async def test_the_client_leaving_kills_every_choice():
    ctx = Context()
    kids = child_contexts(ctx, 3)
    ctx.kill()
    assert all(k.is_killed for k in kids)

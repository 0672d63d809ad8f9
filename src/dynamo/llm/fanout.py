"""``n`` > 1: one request fanned out as n engine requests, their chunks merged with ``index`` i.

Each choice is an ordinary single-choice stream (its own engine request and context, so the engine and
a KV router see n requests; with a ``seed``, choice i uses ``seed + i`` so the choices differ as vLLM's
do).  Chunks keep the request's id; the prompt is counted once in usage and completions are summed.
A client that goes away, or any choice that fails, stops them all.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from dynamo.llm.chunks import Annotation
from dynamo.llm.engine import Context

_END = object()


def child_contexts(ctx: Context, n: int) -> list[Context]:
    """A context per choice, stopped or killed with the request's."""
    children = [Context(f"{ctx.id}-{i}") for i in range(n)]

    def forward(kind: str) -> None:
        for child in children:
            child.kill() if kind == "kill" else child.stop_generating()

    ctx.on_stop(forward)
    return children


async def merge_choices(
    streams: list[AsyncIterator[Any]],
    ctx: Context,
    children: list[Context],
    usage: Callable[[int, int, int | None], dict[str, Any]] | None,
    per_prompt: int = 0,
) -> AsyncIterator[Any]:
    """Interleave the choices' chunks as they come, each relabelled with its choice index.

    ``per_prompt``: the streams are several prompts' choices, that many per prompt in a row (a batched
    completions request), and usage counts each prompt once; 0: they all share one prompt."""
    firsts = range(0, len(children), per_prompt or len(children))
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _END))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            ctx.completion_tokens = sum(c.completion_tokens for c in children)
            ctx.prompt_tokens = sum(children[f].prompt_tokens for f in firsts)
            cached = [children[f].cached_tokens for f in firsts]
            ctx.cached_tokens = None if all(c is None for c in cached) else sum(c or 0 for c in cached)
            if isinstance(item, Annotation):
                if i in firsts:  # a prompt's annotations are the same for each of its choices
                    yield item
                continue
            for choice in item.get("choices") or ():
                choice["index"] = i
            yield item
        if usage is not None:
            yield usage(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)
    finally:
        for child in children:
            child.stop_generating()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]

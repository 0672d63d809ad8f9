"""A core engine served to a Dynamo 1.x frontend: its request in, 1.x's ``LLMEngineOutput`` items out.

Why not the Backend handler's items: a 1.x frontend preprocesses and detokenizes itself (the worker's
card says ``model_input: Tokens``), applies stop strings itself and reads usage from the worker's
``completion_usage``; text from us would be ignored at best. So a request from a 1.x peer (the runtime
tells: ``context.v1_peer``) is served by the engine alone, as 1.6.1's own workers serve it: token ids,
the finish reason in 1.x's words, ``completion_usage`` on the first item and on the last. What the
engine cannot do on its own and 1.x asks of the worker is done here: stopping on (and showing) the
visible stop token ids. What neither can do is refused up front (:func:`dynamo.llm.protocols.v1.request_from_v1`).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from dynamo.llm.engine import Context, Engine
from dynamo.llm.protocols.common import FINISH_CANCELLED, FINISH_STOP, EngineOutput
from dynamo.llm.protocols.v1 import request_from_v1, usage, v1_output

log = logging.getLogger(__name__)


async def v1_token_stream(engine: Engine, request: dict[str, Any], ctx: Context,
                          check_model: Any = None) -> AsyncIterator[dict[str, Any]]:
    """The engine's answer to a 1.x ``PreprocessedRequest`` as 1.x ``LLMEngineOutput`` dicts.

    ``check_model(name)`` refuses a model this worker does not serve (LoRA adapters)."""
    v1 = request_from_v1(request)
    req = v1.request
    if check_model is not None:
        check_model(req.model)
    visible = v1.visible_stop_ids
    prompt = len(req.token_ids)
    generated = 0
    cached: int | None = None
    first = True
    log.debug("request %s (Dynamo 1.x): %d prompt tokens", ctx.id, prompt)
    gen = engine.generate(req, ctx)
    try:
        async for out in gen:
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            tokens = out.token_ids
            reason = out.finish_reason
            if visible:
                for i, tid in enumerate(tokens):
                    if tid in visible:  # shown, and the end: 1.x's stop_token_ids_visible
                        tokens, reason = tokens[:i + 1], FINISH_STOP
                        break
            generated += len(tokens)
            done = reason is not None
            item_usage = usage(prompt, generated, cached) if first or done else None
            first = False
            yield v1_output(out, tokens, reason, item_usage)
            if done:
                return
        # the engine ended without a finish reason: stopped by the client, or done
        reason = FINISH_CANCELLED if ctx.is_stopped else FINISH_STOP
        yield v1_output(EngineOutput(), [], reason, usage(prompt, generated, cached))
    finally:
        ctx.stop_generating()
        await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators

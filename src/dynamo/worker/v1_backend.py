"""A core engine served to a Dynamo 1.x frontend: its request in, 1.x's ``LLMEngineOutput`` items out.

Why not the Backend handler's items: a 1.x frontend preprocesses and detokenizes itself (the worker's
card says ``model_input: Tokens``), applies stop strings itself and reads usage from the worker's
``completion_usage``; text from us would be ignored at best. So a request from a 1.x peer (the runtime
tells: ``context.v1_peer``) is served by the engine alone, as 1.6.1's own workers serve it: token ids,
the finish reason in 1.x's words, ``completion_usage`` on the first item and on the last. What the
engine cannot do on its own and 1.x asks of the worker is done here, on token ids (our own frontend does it in
its post-processor, which a 1.x frontend does not run: measured, 1.6.1's frontend let an echo engine run past
``max_tokens`` and through its end-of-turn token): ``max_tokens`` (finish ``length``), the end-of-sequence
and hidden stop ids unless ``ignore_eos`` or ``min_tokens`` says go on (finish ``eos`` / ``stop``, the id
not shown), and the visible stop ids (shown, finish ``stop``). What neither can do is refused up front
(:func:`dynamo.llm.protocols.v1.request_from_v1`).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from dynamo.llm.engine import Context, Engine
from dynamo.llm.protocols.common import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
)
from dynamo.llm.protocols.v1 import request_from_v1, usage, v1_output

log = logging.getLogger(__name__)


class TokenStops:
    """The request's stop conditions on token ids, applied to each item the engine yields."""

    __slots__ = ("max_tokens", "min_tokens", "eos", "hidden", "visible", "generated")

    def __init__(self, req: PreprocessedRequest, visible: frozenset[int]) -> None:
        stop = req.stop_conditions
        self.max_tokens = stop.max_tokens
        self.min_tokens = stop.min_tokens or 0
        self.eos = frozenset() if stop.ignore_eos else frozenset(req.eos_token_ids)
        self.hidden = frozenset(stop.stop_token_ids_hidden or ())
        self.visible = visible
        self.generated = 0

    def take(self, tokens: list[int], reason: Any) -> tuple[list[int], Any]:
        """(the ids to send, the finish reason) of one item: cut where a condition ends the answer."""
        for i, tid in enumerate(tokens):
            n = self.generated + i  # ids already sent before this one
            if n >= self.min_tokens:
                if tid in self.visible:
                    return self._sent(tokens[:i + 1]), FINISH_STOP
                if tid in self.eos:
                    return self._sent(tokens[:i]), FINISH_EOS
                if tid in self.hidden:
                    return self._sent(tokens[:i]), FINISH_STOP
            if self.max_tokens is not None and n + 1 >= self.max_tokens:
                return self._sent(tokens[:i + 1]), FINISH_LENGTH
        return self._sent(tokens), reason

    def _sent(self, tokens: list[int]) -> list[int]:
        self.generated += len(tokens)
        return tokens


async def v1_token_stream(engine: Engine, request: dict[str, Any], ctx: Context,
                          check_model: Any = None) -> AsyncIterator[dict[str, Any]]:
    """The engine's answer to a 1.x ``PreprocessedRequest`` as 1.x ``LLMEngineOutput`` dicts.

    ``check_model(name)`` refuses a model this worker does not serve (LoRA adapters)."""
    v1 = request_from_v1(request)
    req = v1.request
    if check_model is not None:
        check_model(req.model)
    stops = TokenStops(req, v1.visible_stop_ids)
    prompt = len(req.token_ids)
    cached: int | None = None
    first = True
    log.debug("request %s (Dynamo 1.x): %d prompt tokens", ctx.id, prompt)
    gen = engine.generate(req, ctx)
    try:
        async for out in gen:
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            tokens, reason = stops.take(out.token_ids, out.finish_reason)
            done = reason is not None
            item_usage = usage(prompt, stops.generated, cached) if first or done else None
            first = False
            yield v1_output(out, tokens, reason, item_usage)
            if done:
                return
        # the engine ended without a finish reason: stopped by the client, or done
        reason = FINISH_CANCELLED if ctx.is_stopped else FINISH_STOP
        yield v1_output(EngineOutput(), [], reason, usage(prompt, stops.generated, cached))
    finally:
        ctx.stop_generating()
        await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators

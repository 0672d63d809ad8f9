"""Request handlers a worker serves on its endpoint, one per kind of engine.

A core engine is served as a Backend: asked by our frontend, the worker detokenizes and applies stop
conditions itself (its items carry ``text``), so a frontend only templates and tokenizes, and
detokenization load spreads over the workers.  A full engine is served as Chat: OpenAI chat requests in, chunks out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from dynamo.errors import RequestError
from dynamo.llm.backend import PostProcessor
from dynamo.llm.engine import Context, Engine, ServesLoraAdapters
from dynamo.llm.model_card import ModelCard
from dynamo.llm.parsers.stage import ParseStage
from dynamo.llm.protocols.common import FINISH_CANCELLED, FINISH_STOP, PreprocessedRequest
from dynamo.llm.protocols.wire import output_item, prompt_logprobs_on_wire, read_request, usage
from dynamo.llm.tokenizer import Tokenizer
from dynamo.runtime import tracing
from dynamo.worker.phases import Phases
from dynamo.worker.token_stops import TokenStops

log = logging.getLogger(__name__)


def link_contexts(runtime_ctx: Any, ctx: Context) -> None:
    """Forward stop/kill from the transport's context to the engine's."""
    if runtime_ctx is None:
        return

    def forward(kind: str) -> None:
        if kind == "kill":
            ctx.kill()
        else:
            ctx.stop_generating()

    runtime_ctx.add_callback(forward)
    if runtime_ctx.is_killed():
        ctx.kill()
    elif runtime_ctx.is_stopped():
        ctx.stop_generating()


def check_served_model(model: str | None, base: str, loras: ServesLoraAdapters) -> None:
    """A request must never run with other weights than the model it names: on a worker that serves
    LoRA adapters, ``model`` is its base model, one of its adapters, or absent (the base)."""
    if model and model != base and model not in loras.lora_adapters():
        adapters = sorted(loras.lora_adapters())
        raise RequestError(f"model {model!r} is not served by this worker (it serves {base!r}"
                           f"{' and the LoRA adapters ' + ', '.join(adapters) if adapters else ', no LoRA adapter'})",
                           status=404, param="model", code="model_not_found")


def backend_handler(card: ModelCard, engine: Engine, loras: ServesLoraAdapters | None = None):
    """``loras``: the engine's adapters (the engine itself, unwrapped), if it serves any.

    Every item goes out in 1.x's ``LLMEngineOutput`` layout (llm/protocols/wire.py), ``completion_usage`` on
    the first and the last.  A request that asks for text (``detokenize``: our frontend) gets it where the
    worker has a tokenizer, with what goes with it (stop strings, parsing, logprob entries); without a
    tokenizer it gets the engine's tokens as they are (the frontend post-processes them).  A request that
    does not ask (a Dynamo 1.x frontend) gets token ids with the stop conditions applied on ids."""
    tokenizer = Tokenizer(card.tokenizer_json) if card.has_tokenizer else None  # type: ignore[arg-type]

    def start(request: Any, context: Any) -> tuple[PreprocessedRequest, Context, Phases | None, Any]:
        req = read_request(request)
        if loras is not None:
            check_served_model(req.model, card.display_name, loras)
        ctx = Context(context.id() if context is not None else None)
        link_contexts(context, ctx)
        log.debug("request %s: %d prompt tokens", ctx.id, len(req.token_ids))
        phases = Phases(context.trace, req) if tracing.ENABLED and context is not None and context.trace else None
        ctx.phases = phases  # the engine reports admission and a KV transfer to it (phases.py)
        return req, ctx, phases, engine.generate(req, ctx)

    def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        # one of the two streams itself, not a generator around it: a hop per token costs (worker/phases.py)
        if tokenizer is not None and isinstance(request, dict) and request.get("detokenize"):
            return _text_items(start, request, context, tokenizer)
        return _token_items(start, request, context)

    return generate


async def _token_items(start: Any, request: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
    """Token ids only: cut by the stop conditions (worker/token_stops.py) unless the frontend asked for text,
    which it makes itself then (this worker has no tokenizer)."""
    req, ctx, phases, gen = start(request, context)
    stops = TokenStops(req) if not req.detokenize else None
    prompt = len(req.token_ids)
    cached: int | None = None
    generated = 0
    first = True
    reason: Any = None
    failed: BaseException | None = None
    # a 1.x frontend's prompt logprobs: 1.x's shape, on the last item (where its frontend reads them)
    engine_data: dict[str, Any] | None = None
    try:
        async for out in gen:
            if phases is not None and phases.prefilling:
                phases.first(out)
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            if stops is not None:
                tokens, reason = stops.take(out.token_ids, out.finish_reason)
            else:
                tokens, reason = out.token_ids, out.finish_reason
            generated += len(tokens)
            done = reason is not None
            item = output_item(tokens, reason, usage(prompt, generated, cached) if first or done else None, out=out)
            first = False
            if out.prompt_logprobs is not None:
                if req.detokenize:  # our frontend shapes them (it has the prompt)
                    item["prompt_logprobs"] = out.prompt_logprobs
                else:
                    engine_data = {"prompt_logprobs": prompt_logprobs_on_wire(req.token_ids, out.prompt_logprobs)}
            if done and engine_data is not None:
                item["engine_data"] = engine_data
            yield item
            if done:
                return
        # the engine ended without a finish reason: stopped by the client, or done
        reason = FINISH_CANCELLED if ctx.is_stopped else FINISH_STOP
        last = output_item([], reason, usage(prompt, generated, cached))
        if engine_data is not None:
            last["engine_data"] = engine_data
        yield last
    except (Exception, asyncio.CancelledError) as exc:
        failed = exc
        raise
    finally:
        if phases is not None:
            phases.end(generated, reason, failed)
        ctx.stop_generating()
        await gen.aclose()  # engines' generate() are async generators


async def _text_items(start: Any, request: Any, context: Any, tokenizer: Tokenizer) -> AsyncIterator[dict[str, Any]]:
    """Text: detokenized, stop conditions and strings applied, parsed when asked (llm/backend.py)."""
    req, ctx, phases, gen = start(request, context)
    post = PostProcessor(tokenizer, req)
    stage = ParseStage.for_request(req, tokenizer)  # tool calls and reasoning: parsed here, beside detok
    prompt = len(req.token_ids)
    cached: int | None = None
    first = True
    failed: BaseException | None = None
    try:
        async for out in gen:
            if phases is not None and phases.prefilling:
                phases.first(out)
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            text, reason = post.process(out)
            # 1.x's fields that are null here are left out (our frontend reads them as absent): a text item is
            # three keys, not nine, on the frontend's per-token path
            item = {"token_ids": out.token_ids, "text": text, "finish_reason": reason}
            if first or reason is not None:
                item["completion_usage"] = usage(prompt, post.generated, cached)
            first = False
            if out.disaggregated_params is not None:  # a prefill worker's KV transfer ticket
                item["disaggregated_params"] = out.disaggregated_params
            if out.prompt_logprobs is not None:  # echo: the frontend shapes them (it has the prompt)
                item["prompt_logprobs"] = out.prompt_logprobs
            _text_extras(item, post, reason)
            yield item if stage is None else stage.annotate(item)
            if reason is not None:
                return
        tail = post.end()
        item = {"token_ids": [], "text": tail, "finish_reason": post.finished,
                "completion_usage": usage(prompt, post.generated, cached)}
        _text_extras(item, post, post.finished)
        yield item if stage is None else stage.annotate(item)
    except (Exception, asyncio.CancelledError) as exc:
        failed = exc
        raise
    finally:
        if phases is not None:
            phases.end(post.generated, post.finished, failed)
        ctx.stop_generating()
        await gen.aclose()  # engines' generate() are async generators


def _text_extras(item: dict[str, Any], post: PostProcessor, reason: Any) -> None:
    entries = post.take_logprobs()
    if entries is not None:  # asked for: the entries of the tokens this text came from
        item["logprobs_content"] = entries
    if reason is not None and post.stop_sequence is not None:
        item["stop_reason"] = post.stop_sequence


def chat_handler(served: Any):
    """``served`` is a FullPipeline (or any ServedModel); requests are OpenAI chat request dicts."""
    from dynamo.llm.chunks import Annotation
    from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request

    async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        ctx = Context(context.id() if context is not None else None)
        link_contexts(context, ctx)
        log.debug("request %s", ctx.id)
        if "messages" in request:
            stream = served.chat(parse_chat_request(request), request, ctx)
        else:
            stream = served.completions(parse_completion_request(request), request, ctx)
        try:
            async for chunk in stream:
                if not isinstance(chunk, Annotation):
                    yield chunk
        finally:
            await stream.aclose()

    return generate

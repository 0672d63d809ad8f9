"""Request handlers a worker serves on its endpoint, one per kind of engine.

A core engine is served as a Backend: the worker detokenizes and applies stop conditions itself (its
items carry ``text``), so a frontend only templates and tokenizes, and detokenization load spreads over
the workers.  A full engine is served as Chat: OpenAI chat requests in, chunks out.
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
from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.llm.tokenizer import Tokenizer
from dynamo.runtime import tracing
from dynamo.worker.phases import Phases
from dynamo.worker.v1_backend import v1_token_stream

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
    """``loras``: the engine's adapters (the engine itself, unwrapped), if it serves any."""
    tokenizer = Tokenizer(card.tokenizer_json) if card.has_tokenizer else None  # type: ignore[arg-type]

    def check_model(model: str | None) -> None:
        if loras is not None:
            check_served_model(model, card.display_name, loras)

    async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if context is not None and getattr(context, "v1_peer", False):
            # a Dynamo 1.x frontend: it detokenizes itself and wants 1.x's items (worker/v1_backend.py)
            v1_ctx = Context(context.id())
            link_contexts(context, v1_ctx)
            stream = v1_token_stream(engine, request, v1_ctx, check_model)
            try:
                async for v1_item in stream:
                    yield v1_item
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            return
        req = PreprocessedRequest.from_dict(request)
        if loras is not None:
            check_served_model(req.model, card.display_name, loras)
        ctx = Context(context.id() if context is not None else None)
        link_contexts(context, ctx)
        log.debug("request %s: %d prompt tokens", ctx.id, len(req.token_ids))
        phases = Phases(context.trace, req) if tracing.ENABLED and context is not None and context.trace else None
        ctx.phases = phases  # the engine reports admission and a KV transfer to it (phases.py)
        gen = engine.generate(req, ctx)
        if tokenizer is None:  # no tokenizer: tokens only, the frontend detokenizes
            tokens, reason, error = 0, None, None
            try:
                async for out in gen:
                    if phases is not None:
                        if phases.prefilling:
                            phases.first(out)
                        tokens += len(out.token_ids)
                        reason = out.finish_reason or reason
                    yield out.to_dict()
            except (Exception, asyncio.CancelledError) as exc:
                error = exc
                raise
            finally:
                if phases is not None:
                    phases.end(tokens, reason, error)
                await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators
            return
        post = PostProcessor(tokenizer, req)
        stage = ParseStage.for_request(req, tokenizer)  # tool calls and reasoning: parsed here, beside detok
        failed: BaseException | None = None
        try:
            async for out in gen:
                if phases is not None and phases.prefilling:
                    phases.first(out)
                text, reason = post.process(out)
                item: dict[str, Any] = {"token_ids": out.token_ids, "text": text, "finish_reason": reason}
                if out.cached_tokens is not None:
                    item["cached_tokens"] = out.cached_tokens
                if out.disaggregated_params is not None:  # a prefill worker's KV transfer ticket
                    item["disaggregated_params"] = out.disaggregated_params
                if out.prompt_logprobs is not None:  # echo: the frontend shapes them (it has the prompt)
                    item["prompt_logprobs"] = out.prompt_logprobs
                entries = post.take_logprobs()
                if entries is not None:  # asked for: the entries of the tokens this text came from
                    item["logprobs_content"] = entries
                if reason is not None and post.stop_sequence is not None:
                    item["stop_sequence"] = post.stop_sequence
                yield item if stage is None else stage.annotate(item)
                if reason is not None:
                    return
            tail = post.end()
            item = {"token_ids": [], "text": tail, "finish_reason": post.finished}
            entries = post.take_logprobs()
            if entries is not None:
                item["logprobs_content"] = entries
            if post.stop_sequence is not None:
                item["stop_sequence"] = post.stop_sequence
            yield item if stage is None else stage.annotate(item)
        except (Exception, asyncio.CancelledError) as exc:
            failed = exc
            raise
        finally:
            if phases is not None:
                phases.end(post.generated, post.finished, failed)
            ctx.stop_generating()
            await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators

    return generate


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

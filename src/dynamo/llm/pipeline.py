"""A served model: OpenAI request in, OpenAI chunks out, whatever the engine kind.

``CorePipeline`` wraps a token-level engine with our pre-processor and post-processor; ``FullPipeline``
hands the OpenAI request to an engine that does everything itself.  Inputs (http, text, batch) only see
:class:`ServedModel`, so they treat local engines and remote workers alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

import msgspec
import orjson

from dynamo.errors import RequestError
from dynamo.lazyjson import USAGE_KEY, LazyJson
from dynamo.llm.chunks import Annotation, ChatChunks, CompletionChunks
from dynamo.llm.engine import Context, Engine, capabilities_of
from dynamo.llm.fanout import child_contexts, merge_choices
from dynamo.llm.first_token import stamp
from dynamo.llm.logprobs import Entry
from dynamo.llm.media import MediaError, current_policy, image_parts, inline_images
from dynamo.llm.model_card import ModelCard
from dynamo.llm.parsers.stage import ParseStage
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    include_usage,
)
from dynamo.runtime import tracing

if TYPE_CHECKING:  # the pre/post-processors (jinja2, tokenizers) load with the first CorePipeline
    from dynamo.llm.preprocessor import Preprocessed
    from dynamo.llm.tokenizer import Tokenizer

StreamItem = dict[str, Any] | Annotation


class ServedModel(Protocol):
    name: str
    card: ModelCard
    tokenizer: Tokenizer | None

    @property
    def engine(self) -> object: ...  # what it serves with: closed with it (dynamo.llm.engine.close_engine)

    def chat(self, req: ChatCompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]: ...

    def completions(self, req: CompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]: ...


class CorePipeline:
    """Pre-process, run a token engine, post-process, shape chunks."""

    def __init__(self, name: str, card: ModelCard, engine: Engine):
        self.name = name
        self.card = card
        self.engine = engine
        from dynamo.llm.preprocessor import Preprocessor  # not imported for full engines: start-up time

        self.preprocessor = Preprocessor(card)
        self.tokenizer: Tokenizer | None = self.preprocessor.tokenizer

    def chat(self, req: ChatCompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]:
        from dynamo.llm.tokenizer import OFF_LOOP_CHARS

        span = tracing.start_span("preprocess", ctx.trace) if ctx.trace is not None else None
        try:
            rendered = self.preprocessor.render_chat(req, raw)  # raises RequestError before any streaming starts
            stamp(ctx.stamps, "template")
            if rendered.images:
                return self._chat_images(rendered, req, ctx, span)
            if len(rendered.prompt) >= OFF_LOOP_CHARS:
                # a long prompt is tokenized in a thread: the stream starts with that (errors come with its
                # first item, which every input awaits before it answers)
                return self._chat_off_loop(rendered, req, ctx, span)
            pre = self.preprocessor.finish_chat(rendered, self.tokenizer.encode_prompt(rendered.prompt))  # type: ignore[union-attr]
        except BaseException as exc:
            _end_preprocess(span, None, exc)
            raise
        stamp(ctx.stamps, "tokenized")
        _end_preprocess(span, pre)
        return self._chat_stream(pre, req, ctx)

    async def _chat_images(self, rendered: Any, req: ChatCompletionRequest, ctx: Context,
                           span: tracing.Span | None = None) -> AsyncIterator[StreamItem]:
        """A chat with images: they are loaded (and refused) first, so errors come with the first item."""
        try:
            ids, images = await self.preprocessor.image_prompt(rendered)
        except BaseException as exc:
            _end_preprocess(span, None, exc)
            raise
        stamp(ctx.stamps, "images loaded", f"{len(images)}")
        pre = self.preprocessor.finish_chat(rendered, ids)
        _end_preprocess(span, pre)
        pre.request.multi_modal_data = images
        stream = self._chat_stream(pre, req, ctx)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _chat_off_loop(self, rendered: Any, req: ChatCompletionRequest, ctx: Context,
                             span: tracing.Span | None = None) -> AsyncIterator[StreamItem]:
        try:
            ids = await self.tokenizer.encode_prompt_async(rendered.prompt)  # type: ignore[union-attr]
        except BaseException as exc:
            _end_preprocess(span, None, exc)
            raise
        stamp(ctx.stamps, "tokenized", "in a thread")
        pre = self.preprocessor.finish_chat(rendered, ids)
        _end_preprocess(span, pre)
        stream = self._chat_stream(pre, req, ctx)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _chat_stream(self, pre: Preprocessed, req: ChatCompletionRequest, ctx: Context) -> AsyncIterator[StreamItem]:
        self._check_logprobs(pre)
        if (req.n or 1) > 1:
            return self._choices(pre, req.n, lambda: ChatChunks(req.model, ctx.id), include_usage(req), ctx)  # type: ignore[arg-type]
        return self._stream(pre, ChatChunks(req.model, ctx.id), include_usage(req), ctx)

    def completions(self, req: CompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]:
        from dynamo.llm.tokenizer import OFF_LOOP_CHARS

        prompts = self.preprocessor.completion_prompts(req)
        if len(prompts) > 1:
            return self._batch(prompts, req, raw, ctx)
        span = tracing.start_span("preprocess", ctx.trace) if ctx.trace is not None else None
        try:
            text = self.preprocessor.completion_text(req)
            if text is not None and len(text) >= OFF_LOOP_CHARS:
                return self._completions_off_loop(text, req, raw, ctx, span)
            pre = self.preprocessor.completion(req, raw)
        except BaseException as exc:
            _end_preprocess(span, None, exc)
            raise
        _end_preprocess(span, pre)
        return self._completions_stream(pre, req, ctx)

    async def _completions_off_loop(self, text: str, req: CompletionRequest, raw: dict[str, Any],
                                    ctx: Context, span: tracing.Span | None = None) -> AsyncIterator[StreamItem]:
        try:
            ids = await self.tokenizer.encode_prompt_async(text)  # type: ignore[union-attr]
            pre = self.preprocessor.completion(req, raw, ids)
        except BaseException as exc:
            _end_preprocess(span, None, exc)
            raise
        _end_preprocess(span, pre)
        stream = self._completions_stream(pre, req, ctx)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _completions_stream(self, pre: Preprocessed, req: CompletionRequest, ctx: Context) -> AsyncIterator[StreamItem]:
        echo = self._echo(pre, req)
        if (req.n or 1) > 1:
            return self._choices(pre, req.n, lambda: CompletionChunks(req.model, ctx.id), include_usage(req), ctx,  # type: ignore[arg-type]
                                 echo)
        return self._stream(pre, CompletionChunks(req.model, ctx.id), include_usage(req), ctx, echo)

    def _echo(self, pre: Preprocessed, req: CompletionRequest) -> str | None:
        """The prompt text to echo (a token-id prompt's decoded, special tokens kept so that the text is
        what its tokens' logprob entries spell), and the engine asked for its logprobs.  ``max_tokens``
        0 (echo only) asks the engine for one token, which :meth:`_stream` does not pass on."""
        self._check_logprobs(pre, echo=bool(req.echo))
        request = pre.request
        if request.output_options.logprobs is not None:
            request.output_options.stop_token_logprobs = True
        if not req.echo:
            return None
        echo = pre.formatted_prompt
        if echo is None:
            echo = self.tokenizer.decode(request.token_ids) if self.tokenizer is not None else ""
        if request.output_options.logprobs is not None:
            request.output_options.prompt_logprobs = request.output_options.logprobs
        if request.stop_conditions.max_tokens == 0:
            request.stop_conditions.max_tokens = 1
            request.stop_conditions.min_tokens = None
            pre.prompt_only = True
        return echo

    async def _batch(self, prompts: list[str | list[int]], req: CompletionRequest, raw: dict[str, Any],
                     ctx: Context) -> AsyncIterator[StreamItem]:
        """Several prompts in one request (a list of texts or of token-id lists): each is its own engine
        request (``n`` each), its choices numbered prompt by prompt, as vLLM numbers them; usage counts
        every prompt once.  Every prompt is checked before any engine starts."""
        n = req.n or 1
        pres = []
        for prompt in prompts:
            ids = await self.tokenizer.encode_prompt_async(prompt) if isinstance(prompt, str) else None  # type: ignore[union-attr]
            pres.append(self.preprocessor.completion(req, raw, ids, prompt))
        echoes = [self._echo(pre, req) for pre in pres]
        children = child_contexts(ctx, len(pres) * n)
        streams = []
        for p, (pre, echo) in enumerate(zip(pres, echoes, strict=True)):
            for i in range(n):
                streams.append(self._stream(self._choice_request(pre, n, i), CompletionChunks(req.model, ctx.id),
                                            False, children[p * n + i], echo))
        usage = CompletionChunks(req.model, ctx.id).usage if include_usage(req) else None
        merged = merge_choices(streams, ctx, children, usage, per_prompt=n)
        try:
            async for item in merged:
                yield item
        finally:
            await merged.aclose()  # type: ignore[attr-defined]

    def _check_logprobs(self, pre: Preprocessed, echo: bool = False) -> None:
        """Logprobs from an engine that gives none would be ``null`` or made up: a 400 instead.  ``echo``
        with logprobs needs the prompt's too, which not every engine computes."""
        if pre.request.output_options.logprobs is None:
            return
        if not self.card.logprobs:
            raise RequestError(f"logprobs: the engine serving {self.name!r} does not return logprobs",
                               param="logprobs")
        if echo and not self.card.prompt_logprobs:
            raise RequestError(f"echo with logprobs: the engine serving {self.name!r} does not compute the "
                               "prompt's logprobs", param="echo")

    def _choices(self, pre: Preprocessed, n: int, make_chunks: Any, with_usage: bool, ctx: Context,
                 echo: str | None = None) -> AsyncIterator[StreamItem]:
        """``n`` > 1: n single-choice streams merged (fanout.py)."""
        children = child_contexts(ctx, n)
        streams = [self._stream(self._choice_request(pre, n, i), make_chunks(), False, child, echo)
                   for i, child in enumerate(children)]
        usage = make_chunks().usage if with_usage else None
        return merge_choices(streams, ctx, children, usage)

    @staticmethod
    def _choice_request(pre: Preprocessed, n: int, i: int) -> Preprocessed:
        """Choice ``i`` of ``n``: its own engine request; with a seed, ``seed + i`` so the choices differ."""
        if n == 1:
            return pre
        seed = pre.request.sampling_options.seed
        request = msgspec.structs.replace(pre.request, sampling_options=msgspec.structs.replace(
            pre.request.sampling_options, n=None, seed=None if seed is None else seed + i))
        return type(pre)(request, pre.formatted_prompt, pre.prompt_only)

    async def _stream(
        self,
        pre: Preprocessed,
        chunks: ChatChunks | CompletionChunks,
        with_usage: bool,
        ctx: Context,
        echo: str | None = None,
    ) -> AsyncIterator[StreamItem]:
        request = pre.request
        request.model = self.name
        ctx.prompt_tokens = len(request.token_ids)
        for name in request.annotations:
            value = _annotation(name, pre, ctx)
            if value is not None:
                yield Annotation(name, value)
        # logprobs: entries ride on the next chunk sent after their text was released (``carried``)
        carried: list[Entry] | None = [] if request.output_options.logprobs is not None else None
        if echo and request.output_options.prompt_logprobs is None:
            yield chunks.delta(echo, logprobs=carried)
            echo = None  # else sent with the prompt's logprobs, which come with the engine's first item
            if pre.prompt_only:  # echo alone, nothing the engine could add
                yield chunks.delta(None, "length", logprobs=carried)
                if with_usage:
                    yield chunks.usage(ctx.prompt_tokens, 0, None)
                return
        from dynamo.llm.backend import PostProcessor

        post = PostProcessor(self.tokenizer, request)  # type: ignore[arg-type]
        stage = ParseStage.for_request(request) if isinstance(chunks, ChatChunks) else None
        gen = self.engine.generate(request, ctx)
        stamps = ctx.stamps  # (the first item's detokenization is stamped; None: not stamping)
        reason: str | None = None
        try:
            async for out in gen:
                if out.cached_tokens is not None and ctx.cached_tokens is None:
                    ctx.cached_tokens = min(out.cached_tokens, ctx.prompt_tokens)
                if echo:
                    yield chunks.delta(echo, logprobs=post.prompt_logprobs(out) or [])
                    echo = None
                if pre.prompt_only:  # the engine's token only brought the prompt's logprobs
                    reason = "length"
                    break
                text, reason = post.process(out)
                if stamps is not None:
                    stamp(stamps, "detokenized", f"{len(text)} chars")
                    stamps = None
                ctx.completion_tokens = post.generated
                if carried is not None:
                    carried += post.take_logprobs() or ()
                if stage is not None:
                    for delta in stage.deltas(out, text, reason is not None):
                        yield chunks.parsed(delta, carried)  # type: ignore[union-attr]
                        carried = [] if carried is not None else None
                elif text:
                    yield chunks.delta(text, logprobs=carried)
                    carried = [] if carried is not None else None
                if reason is not None:
                    break
            else:
                tail = post.end()
                if carried is not None:
                    carried += post.take_logprobs() or ()
                if stage is not None:
                    for delta in stage.parse(tail, True):
                        yield chunks.parsed(delta, carried)  # type: ignore[union-attr]
                        carried = [] if carried is not None else None
                elif tail:
                    yield chunks.delta(tail, logprobs=carried)
                    carried = [] if carried is not None else None
                reason = post.finished
        finally:
            ctx.stop_generating()  # idempotent: tells the engine we are done, whatever ended the loop
            await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators
        if echo:  # the engine sent nothing at all: the echo still goes out
            yield chunks.delta(echo, logprobs=[])
        reason = stage.finish_reason(reason) if stage is not None else reason
        if ctx.trace is not None and reason is not None:
            ctx.trace.set_attribute("gen_ai.response.finish_reasons", [reason])
        last = chunks.delta(None, reason, logprobs=carried)
        if post.stop_sequence is not None:  # vLLM's field: the stop string that ended the answer
            last["choices"][0]["stop_reason"] = post.stop_sequence
        yield last
        if with_usage:
            yield chunks.usage(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)


def _end_preprocess(span: tracing.Span | None, pre: Preprocessed | None, error: BaseException | None = None) -> None:
    """End the request's pre-processing span (template, images, tokenize): its prompt's token count, or
    what failed."""
    if span is None:
        return
    if pre is not None:
        span.set_attribute("gen_ai.usage.input_tokens", len(pre.request.token_ids))
    if error is not None:
        tracing.fail(span, str(error) or type(error).__name__)
    span.end()


def _annotation(name: str, pre: Preprocessed, ctx: Context) -> Any:
    if name == "formatted_prompt":
        return pre.formatted_prompt
    if name == "token_ids":
        return orjson.dumps(pre.request.token_ids).decode()
    if name == "request_id":
        return ctx.id
    return None


class FullPipeline:
    """An engine that takes OpenAI requests and yields OpenAI chunks itself (echo_full, pystr, mistralrs).

    Usage is appended when the client asked for it and the engine did not send one; the engine reports
    counts through ``ctx`` when it knows them.  An engine with ``wants_raw_request = True`` (pystr) also
    gets the request dict exactly as the client sent it: ``generate(req, ctx, raw=raw)``; when its card
    says ``image_urls`` (pystr with ``generate.images = True``, a remote worker serving one), a chat's
    images are loaded under the media policy first and reach it as checked ``data:`` URLs.  An engine
    with ``sends_usage = True`` (echo_full) does that itself, and its stream is passed on as it is: one
    async-generator layer less, two frame resumptions per token (docs/performance.md).
    """

    def __init__(self, name: str, card: ModelCard, engine: Engine, tokenizer: Tokenizer | None = None):
        self.name = name
        self.card = card
        self.engine = engine
        self.tokenizer = tokenizer
        caps = capabilities_of(engine)
        self._pass_raw = caps.wants_raw_request
        self._as_is = caps.sends_usage and not caps.wants_raw_request

    def chat(self, req: ChatCompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]:
        self._check_n(req)
        if image_parts(raw.get("messages")):
            # an engine given the request as sent must never get a client's URL to fetch under no policy:
            # one that takes images gets them loaded and checked here, the others none
            if not (self.card.image_urls and self._pass_raw):
                raise MediaError(f"model {self.card.display_name!r} does not accept images")
            return self._chat_images(req, raw, ctx)
        if self._as_is:
            return self.engine.generate(req, ctx)
        return self._stream(req, raw, ChatChunks(req.model, ctx.id), ctx)

    async def _chat_images(self, req: ChatCompletionRequest, raw: dict[str, Any], ctx: Context
                           ) -> AsyncIterator[StreamItem]:
        """The images loaded (and refused) first, so errors come with the first item; the engine gets the
        request with each image as a ``data:`` URL of its checked bytes.  A remote worker serving such an
        engine loads them again under its own policy (``data:`` URLs pass it): one more decode per image,
        and a worker reached by something other than a frontend still fetches nothing."""
        raw, images = await inline_images(raw, current_policy())
        stamp(ctx.stamps, "images loaded", f"{len(images)}")
        stream = self._stream(req, raw, ChatChunks(req.model, ctx.id), ctx)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def completions(self, req: CompletionRequest, raw: dict[str, Any], ctx: Context) -> AsyncIterator[StreamItem]:
        self._check_n(req)
        if self._as_is:
            return self.engine.generate(req, ctx)
        return self._stream(req, raw, CompletionChunks(req.model, ctx.id), ctx)

    def _check_n(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """Engines that take the request as sent (pystr, remote Chat workers) see ``n``; the others give
        one choice, so more is a 400 rather than fewer choices than asked."""
        if (req.n or 1) > 1 and not self._pass_raw:
            raise RequestError("n > 1 is not supported by this engine", param="n")

    async def _stream(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        raw: dict[str, Any],
        chunks: ChatChunks | CompletionChunks,
        ctx: Context,
    ) -> AsyncIterator[StreamItem]:
        want_usage = include_usage(req)
        saw_usage = False
        gen = self.engine.generate(req, ctx, raw=raw) if self._pass_raw else self.engine.generate(req, ctx)  # type: ignore[call-arg]
        try:
            async for chunk in gen:
                if type(chunk) is LazyJson and chunk.raw is not None and USAGE_KEY not in chunk.raw:
                    yield chunk  # a remote worker's chunk without usage (checked on its bytes)
                    continue
                if want_usage and chunk.get("usage"):
                    saw_usage = True
                elif not want_usage and "usage" in chunk:
                    if not chunk.get("choices"):
                        continue
                    chunk = {k: v for k, v in chunk.items() if k != "usage"}
                yield chunk
        finally:
            ctx.stop_generating()
            await gen.aclose()  # type: ignore[attr-defined]  # engines' generate() are async generators
        if want_usage and not saw_usage:
            yield chunks.usage(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)

"""A traced request's phases on a worker, as spans under the worker's server span.

``queue`` from the request's arrival until the engine's scheduler admits it (engines that report
admission: the mocker; docs/metrics.md lists them), ``prefill`` from there until the engine's first item,
with the prompt's tokens and the cached ones the engine reports, ``decode`` from there to the end, with
the tokens generated and the finish reason.  An engine that does not report admission gets no ``queue``
span: its ``prefill`` includes the wait.  A disaggregated decode's fetch of the prefill worker's KV state
is a ``kv_transfer`` span (bytes, tokens, blocks), and the queue starts once it is over.

Why the spans are made when a phase ends, with the start time it had: the engine reports admission from
inside its scheduler's step, where making a span would be work on the scheduler's time; a timestamp is
all it costs there.  Spans leave the process only once they end anyway.

Why not a wrapper generator around the engine's stream: one more generator hop per token cost about as
much as all the spans of a request (benchmarks/tracing_overhead.py); the handler's loop tests
``phases.prefilling`` instead, and only a traced request has a :class:`Phases` at all.
"""

from __future__ import annotations

import time
from typing import Any

from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.runtime import tracing


class Phases:
    """The :class:`~dynamo.llm.engine.PhaseReport` of one traced request (set as its context's ``phases``)."""

    __slots__ = ("parent", "attributes", "since", "admitted_at", "prefilling", "decode")

    def __init__(self, parent: tracing.Span, req: PreprocessedRequest) -> None:
        self.parent = parent
        self.attributes: dict[str, Any] = {"gen_ai.request.model": req.model or "",
                                           "gen_ai.usage.input_tokens": len(req.token_ids)}
        self.since = time.time_ns()  # where the next phase (queue, or prefill) starts
        self.admitted_at: int | None = None
        self.prefilling = True
        self.decode: tracing.Span | None = None

    # -- what the engine reports
    def admitted(self) -> None:
        if self.admitted_at is None:  # a pre-empted request admitted again: its first admission counts
            self.admitted_at = time.time_ns()

    def kv_transfer(self, started_ns: int, n_bytes: int, n_tokens: int, blocks: int | None,
                    error: str | None = None) -> None:
        attributes = {"dynamo.kv_transfer.bytes": n_bytes, "dynamo.kv_transfer.tokens": n_tokens}
        if blocks is not None:
            attributes["dynamo.kv_transfer.blocks"] = blocks
        span = tracing.start_span("kv_transfer", self.parent, attributes=attributes, start_time=started_ns)
        if span is not None:
            if error is not None:
                tracing.fail(span, error)
            span.end()
        self.since = time.time_ns()

    # -- what the handler sees
    def first(self, out: Any) -> None:
        """The engine's first item: prefill ends, decode starts."""
        if out.cached_tokens is not None:
            self.attributes["gen_ai.usage.cache_read.input_tokens"] = out.cached_tokens
        self._prefill(None)
        self.decode = tracing.start_span("decode", self.parent)

    def end(self, tokens: int, reason: str | None, error: BaseException | None = None) -> None:
        if self.prefilling:  # it ended (or failed) before its first token
            self._prefill(error)
            return
        decode, self.decode = self.decode, None
        if decode is None:
            return
        if error is not None:
            tracing.fail(decode, str(error) or type(error).__name__)
        decode.set_attribute("gen_ai.usage.output_tokens", tokens)
        if reason is not None:
            decode.set_attribute("gen_ai.response.finish_reasons", [reason])
        decode.end()

    def _prefill(self, error: BaseException | None) -> None:
        self.prefilling = False
        now = time.time_ns()
        start = self.since
        admitted = self.admitted_at
        if admitted is not None:
            queue = tracing.start_span("queue", self.parent, start_time=start)
            if queue is not None:
                queue.end(max(admitted, start))
            start = max(admitted, start)
        prefill = tracing.start_span("prefill", self.parent, attributes=self.attributes, start_time=start)
        if prefill is None:
            return
        if error is not None:
            tracing.fail(prefill, str(error) or type(error).__name__)
        prefill.end(now)

"""Post-processing of a core engine's token stream (spec 3.8, with our decisions).

Per token: incremental detokenisation, then the stop conditions in this order: ``min_tokens`` (nothing
stops before it), hidden stop tokens (EOS and ``stop_token_ids``: never shown), stop strings (held back
so no part of one is ever shown), ``max_tokens`` (enforced here for every engine).  Items that arrive
already detokenised (``text`` set by a remote Backend worker that did this work) pass through.
"""

from __future__ import annotations

from dynamo.errors import EngineError
from dynamo.llm.detokenizer import IncrementalDetokenizer
from dynamo.llm.protocols.common import (
    FINISH_CONTENT_FILTER,
    FINISH_LENGTH,
    EngineOutput,
    PreprocessedRequest,
    finish_error_message,
)
from dynamo.llm.stop_strings import StopStringMatcher
from dynamo.llm.tokenizer import Tokenizer


def openai_finish_reason(engine_reason: str) -> str:
    if engine_reason == FINISH_LENGTH:
        return "length"
    if engine_reason == FINISH_CONTENT_FILTER:
        return "content_filter"
    return "stop"  # eos, stop, cancelled


class PostProcessor:
    """One request's decoder and stop checker.  ``process`` returns (text, finish_reason or None)."""

    __slots__ = ("_detok", "_stops", "_hidden", "_min", "_max", "generated", "finished")

    def __init__(self, tokenizer: Tokenizer, request: PreprocessedRequest):
        sc = request.stop_conditions
        self._detok = IncrementalDetokenizer(tokenizer, request.token_ids)
        self._stops = StopStringMatcher(sc.stop) if sc.stop else None
        self._hidden = frozenset(sc.stop_token_ids_hidden or ())
        self._min = sc.min_tokens or 0
        self._max = sc.max_tokens
        self.generated = 0
        self.finished: str | None = None

    def process(self, out: EngineOutput) -> tuple[str, str | None]:
        error = finish_error_message(out.finish_reason)
        if error is not None:
            raise EngineError(error)
        if out.text is not None:  # detokenised upstream: stop handling was done there
            self.generated += len(out.token_ids)
            reason: str | None = (openai_finish_reason(out.finish_reason)
                                  if isinstance(out.finish_reason, str) and out.finish_reason else None)
            if reason is None and self._max is not None and self.generated >= self._max:
                reason = "length"
            self.finished = reason
            return out.text, reason

        pieces: list[str] = []
        reason = None
        for token_id in out.token_ids:
            self.generated += 1
            text = self._detok.step(token_id)
            if self.generated > self._min:
                if token_id in self._hidden:
                    reason = "stop"
                    break
                if self._stops is not None and text:
                    text, matched = self._stops.feed(text)
                    if matched:
                        pieces.append(text)
                        self.finished = "stop"
                        return "".join(pieces), "stop"
            elif self._stops is not None and text:
                # before min_tokens nothing stops, but held-back text must keep its order
                text = self._stops.flush() + text
            pieces.append(text)
            if self._max is not None and self.generated >= self._max:
                reason = "length"
                break
        if reason is None and out.finish_reason is not None:
            reason = openai_finish_reason(out.finish_reason)  # type: ignore[arg-type]
        if reason is not None:
            pieces.append(self._flush())
            self.finished = reason
        return "".join(pieces), reason

    def end(self) -> str:
        """The engine's stream ended without a finish reason: release what is held back."""
        self.finished = self.finished or "stop"
        return self._flush()

    def _flush(self) -> str:
        text = self._detok.flush()
        if self._stops is not None:
            if text:
                text, matched = self._stops.feed(text)
                if matched:
                    return text
            text += self._stops.flush()
        return text

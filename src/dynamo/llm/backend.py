"""Post-processing of a core engine's token stream: detokenize, hold back stop strings, count, finish (our decisions in docs/decisions.md).

Per token: incremental detokenisation, then the stop conditions in this order: ``min_tokens`` (nothing
stops before it), hidden stop tokens (EOS and ``stop_token_ids``: never shown; the logprob entry of the one
that ends the choice is kept only when the request asks, as completions do), stop strings (held back so
no part of one is ever shown), visible stop tokens (shown, then the end), ``max_tokens`` (enforced here for every engine).  Items that arrive
already detokenised (``text`` set by a remote Backend worker that did this work) pass through.
"""

from __future__ import annotations

from dynamo.errors import EngineError
from dynamo.llm.detokenizer import IncrementalDetokenizer
from dynamo.llm.logprobs import Entry, LogprobCarrier, token_bytes
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
    """One request's decoder and stop checker.  ``process`` returns (text, finish_reason or None); with
    logprobs asked for, :meth:`take_logprobs` then gives the entries of the tokens that text came from."""

    __slots__ = ("_detok", "_stops", "_hidden", "_visible", "_min", "_max", "_lp", "_released", "_prompt", "_prompt_n", "_tokenizer",
                 "_stop_entry", "generated", "finished", "_upstream_stop")

    def __init__(self, tokenizer: Tokenizer, request: PreprocessedRequest):
        sc = request.stop_conditions
        self._detok = IncrementalDetokenizer(tokenizer, request.token_ids)
        self._stops = StopStringMatcher(sc.stop) if sc.stop else None
        self._hidden = frozenset(sc.stop_token_ids_hidden or ())
        self._visible = frozenset(sc.stop_token_ids_visible or ())  # stop after showing one of these
        self._min = sc.min_tokens or 0
        self._max = sc.max_tokens
        n = request.output_options.logprobs
        self._lp = LogprobCarrier(token_bytes(tokenizer), n) if n is not None else None
        self._released: list[Entry] = []
        self._prompt = request.token_ids  # (an engine may resume the request with more: not ours to show)
        self._prompt_n = request.output_options.prompt_logprobs or 0
        self._stop_entry = bool(request.output_options.stop_token_logprobs)
        self._tokenizer = tokenizer
        self.generated = 0
        self.finished: str | None = None
        self._upstream_stop: str | None = None

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
            if isinstance(out.stop_reason, str):  # (1.x may name a stop token id there: not text)
                self._upstream_stop = out.stop_reason
            if self._lp is not None and out.logprobs_content:
                self._released += out.logprobs_content
            return out.text, reason

        lp = self._lp
        pieces: list[str] = []
        reason = None
        if lp is not None:
            lp.item_index = 0
        for token_id in out.token_ids:
            self.generated += 1
            text = self._detok.step(token_id)
            if self.generated > self._min:
                if token_id in self._hidden:
                    if lp is not None and self._stop_entry:
                        self._carry(out, 0)
                    reason = "stop"
                    break
                if lp is not None:
                    self._carry(out, len(text))
                if self._stops is not None and text:
                    text, matched = self._stops.feed(text)
                    if matched:
                        pieces.append(text)
                        self.finished = "stop"
                        return self._done("".join(pieces), "stop", cut=True)
                if self._visible and token_id in self._visible:
                    pieces.append(text)
                    reason = "stop"
                    break
            else:
                if lp is not None:
                    self._carry(out, len(text))
                if self._stops is not None and text:
                    # before min_tokens nothing stops, but held-back text must keep its order
                    text = self._stops.flush() + text
            pieces.append(text)
            if self._max is not None and self.generated >= self._max:
                reason = "length"
                break
        if reason is None and out.finish_reason is not None:
            reason = openai_finish_reason(out.finish_reason)  # type: ignore[arg-type]
        if reason is not None:
            tail, cut = self._flush()
            pieces.append(tail)
            self.finished = reason
            return self._done("".join(pieces), reason, cut)
        text = "".join(pieces)
        if lp is not None:
            self._released += lp.release(len(text))
        return text, None

    def end(self) -> str:
        """The engine's stream ended without a finish reason: release what is held back."""
        self.finished = self.finished or "stop"
        tail, cut = self._flush()
        return self._done(tail, "stop", cut)[0]

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer (None: it ended otherwise, or has not ended)."""
        if self._upstream_stop is not None:
            return self._upstream_stop
        return self._stops.matched if self._stops is not None and self.finished == "stop" else None

    def take_logprobs(self) -> list[Entry] | None:
        """The entries released with the text of the last ``process``/``end`` (None: not asked for)."""
        if self._lp is None:
            return None
        out, self._released = self._released, []
        return out

    def prompt_logprobs(self, out: EngineOutput) -> list[Entry] | None:
        """The prompt's entries (``echo``), from an item that carries the engine's prompt logprobs."""
        if out.prompt_logprobs is None:
            return None
        return token_bytes(self._tokenizer).prompt_entries(self._prompt, out.prompt_logprobs, self._prompt_n)

    def _carry(self, out: EngineOutput, n_chars: int) -> None:
        """The item's next token (in order: every token up to a hidden one is carried) produced n_chars."""
        lp = self._lp
        assert lp is not None
        i = lp.item_index
        lp.item_index += 1
        lps = out.log_probs
        if lps is None or i >= len(lps):
            return  # the engine sent none for this token (capability checks make this an engine bug)
        tops = out.top_logprobs[i] if out.top_logprobs is not None and i < len(out.top_logprobs) else None
        lp.token(out.token_ids[i], lps[i], tops, n_chars)

    def _done(self, text: str, reason: str | None, cut: bool = False) -> tuple[str, str | None]:
        if self._lp is not None:
            self._released += self._lp.release(len(text), final=reason is not None, cut=cut)
        return text, reason

    def _flush(self) -> tuple[str, bool]:
        """Everything held back, and whether a stop string cut some of it off."""
        text = self._detok.flush()
        if self._lp is not None:
            self._lp.flushed(len(text))
        if self._stops is not None:
            if text:
                text, matched = self._stops.feed(text)
                if matched:
                    return text, True
            text += self._stops.flush()
        return text, False

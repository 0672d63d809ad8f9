"""A core engine's answer as token ids only, the stop conditions applied on ids: what a worker sends to a
frontend that did not ask for text (a Dynamo 1.x frontend, which never does: its card says
``model_input: Tokens``, it detokenizes and applies stop strings itself and reads usage from the worker's
``completion_usage``).

Why the worker applies them: such a frontend does not (measured, 1.6.1's frontend let an echo engine run
past ``max_tokens`` and through its end-of-turn token), and an engine may not either.  So, per item:
``max_tokens`` (finish ``length``), the end-of-sequence and hidden stop ids unless ``ignore_eos`` or
``min_tokens`` says go on (finish ``eos`` / ``stop``, the id not shown), and the visible stop ids (shown,
finish ``stop``).  What neither can do is refused up front (:func:`dynamo.llm.protocols.wire.read_request`).
"""

from __future__ import annotations

from typing import Any

from dynamo.llm.protocols.common import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, PreprocessedRequest


class TokenStops:
    """The request's stop conditions on token ids, applied to each item the engine yields."""

    __slots__ = ("max_tokens", "min_tokens", "eos", "hidden", "visible", "generated")

    def __init__(self, req: PreprocessedRequest) -> None:
        stop = req.stop_conditions
        self.max_tokens = stop.max_tokens
        self.min_tokens = stop.min_tokens or 0
        self.eos = frozenset() if stop.ignore_eos else frozenset(req.eos_token_ids)
        self.hidden = frozenset(stop.stop_token_ids_hidden or ())
        self.visible = frozenset(stop.stop_token_ids_visible or ())
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

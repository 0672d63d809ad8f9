"""The frontend's disaggregation rule: where a request's prompt is prefilled.

A request goes to a prefill worker first (the caller picks one, KV-aware under ``--router-mode kv``,
since prefix overlap is what a prefill worker saves), which returns a :class:`~.transfer.Ticket`; then to
a decode worker (by load) with that ticket, which pulls the KV state and continues.  It is prefilled
locally on the decode worker instead (conditional disaggregation) when

* no prefill worker serves the model, or
* the tokens the decode worker would have to compute, prompt minus its cached prefix, are at most
  ``max_local_prefill_length`` (short prompts, and prompts mostly cached on the decode worker already:
  moving their state costs more than computing the rest), or
* the prefill fails in any way (worker gone, error, no ticket): the request is not lost, only slower.

The same rule as Dynamo's ``prefill_length - prefix_hit_length > max_local_prefill_length``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from .handover import HandOver, parse_hand_over
from .transfer import TransferError

log = logging.getLogger(__name__)

DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 128


@dataclass(frozen=True)
class Decision:
    remote: bool
    reason: str


def decide(prompt_tokens: int, decode_cached_tokens: int, prefill_workers: int,
           max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH) -> Decision:
    """Prefill remotely or locally (see the module docstring)."""
    if prefill_workers <= 0:
        return Decision(False, "no prefill worker")
    uncached = prompt_tokens - min(max(decode_cached_tokens, 0), prompt_tokens)
    if uncached <= max_local_prefill_length:
        why = "short prompt" if decode_cached_tokens <= 0 else "prefix cached on the decode worker"
        return Decision(False, f"{why}: {uncached} tokens to compute <= {max_local_prefill_length}")
    return Decision(True, f"{uncached} tokens to compute")


# prefill(request) -> the prefill worker's hand-over (handover.py) as a dict (raises on failure)
PrefillFn = Callable[[Any], Awaitable[dict[str, Any]]]
# decode(request, hand-over or None) -> the decode worker's stream
DecodeFn = Callable[[Any, "HandOver | None"], AsyncIterator[Any]]


class DisaggStats:
    """Where prompts were prefilled; ``observe(kind)`` (kind: remote, local, fallback) feeds /metrics."""

    def __init__(self, observe: Callable[[str], None] | None = None) -> None:
        self.remote = 0
        self.local = 0
        self.fallbacks = 0
        self.observe = observe

    def count(self, kind: str) -> None:
        attr = "fallbacks" if kind == "fallback" else kind
        setattr(self, attr, getattr(self, attr) + 1)
        if self.observe is not None:
            self.observe(kind)


async def serve(request: Any, *, prompt_tokens: int, decode_cached_tokens: int, prefill_workers: int,
                prefill: PrefillFn, decode: DecodeFn, max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
                stats: DisaggStats | None = None) -> AsyncIterator[Any]:
    """Run one request through the rule: remote prefill then decode, or decode with local prefill.

    A failed prefill never fails the request: it is logged and the decode worker prefills itself.  (The
    decode worker does the same when the pull of the state fails: see the engine.)
    """
    d = decide(prompt_tokens, decode_cached_tokens, prefill_workers, max_local_prefill_length)
    ticket: HandOver | None = None
    if d.remote:
        try:
            ticket = parse_hand_over(await prefill(request))
        except Exception as e:  # noqa: BLE001 - any prefill failure means local prefill, never an error
            log.warning("remote prefill failed (%s); prefilling on the decode worker", e)
            if stats:
                stats.count("fallback")
    else:
        log.debug("local prefill: %s", d.reason)
    if stats:
        stats.count("remote" if ticket is not None else "local")
    async for item in decode(request, ticket):
        yield item


__all__ = ["Decision", "DisaggStats", "decide", "serve", "TransferError", "DEFAULT_MAX_LOCAL_PREFILL_LENGTH"]

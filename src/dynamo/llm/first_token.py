"""Where a request's time to first token goes: stamps along its path, one debug line per request.

Time to first token is spread over the HTTP layer (body read), the pre-processor (template, tokenize),
the engine (queue, slot admission, the prompt step) and the hand-off back to the event loop and the
socket; no single profile shows how one request's milliseconds split between them.  With the
``dynamo.ttft`` logger at debug level (``-v``), the HTTP service starts a list of stamps on the
request's :class:`~dynamo.llm.engine.Context`, each stage appends to it (an engine from its own
thread: ``list.append`` is atomic), and the first write of the response logs them all as offsets from
the request's arrival.  Without ``-v`` ``ctx.stamps`` stays ``None`` and each stage pays one ``is None``
test per request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("dynamo.ttft")

Stamps = list[tuple[str, float, str]]  # (what happened, time.perf_counter(), detail)


def begin(ctx: Any, arrived: float | None = None) -> None:
    """Start stamping ``ctx`` if the ``dynamo.ttft`` log is on; ``arrived``: when the request came in
    (``time.perf_counter()``, before its body was read), else now."""
    if log.isEnabledFor(logging.DEBUG):
        ctx.stamps = [("in", time.perf_counter() if arrived is None else arrived, "")]
        stamp(ctx.stamps, "parsed")


def stamp(stamps: Stamps | None, what: str, detail: str = "") -> None:
    """Append a stamp (any thread); nothing when the request is not being stamped."""
    if stamps is not None:
        stamps.append((what, time.perf_counter(), detail))


def report(ctx: Any, what: str = "first write") -> None:
    """Log the request's stamps as milliseconds since its arrival, once (stamping ends here)."""
    stamps: Stamps | None = ctx.stamps
    if stamps is None:
        return
    ctx.stamps = None
    stamps.append((what, time.perf_counter(), ""))
    log.debug("request %s: %s", ctx.id, format_stamps(stamps))


def format_stamps(stamps: Stamps) -> str:
    t0 = stamps[0][1]
    return ", ".join(f"{what} {1e3 * (t - t0):.1f}" + (f" ({detail})" if detail else "")
                     for what, t, detail in stamps[1:])
